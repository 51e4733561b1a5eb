"""The decode worker's queue of sequences waiting for room in its KV pool: let go in arrival
order, as many at the head as the free blocks hold together; a timed-out waiter leaves it."""

from __future__ import annotations

import asyncio

from services.decode.admission import RoomWaiters


async def settle() -> None:
    """Let the woken waiters run to their next await."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_the_head_goes_first_and_only_what_fits():
    async def run() -> list[int]:
        room = RoomWaiters()
        done: list[int] = []

        async def waiter(i: int, blocks: int) -> None:
            await room.wait(blocks, 5.0)
            done.append(i)

        tasks = [asyncio.create_task(waiter(i, b)) for i, b in enumerate([4, 2, 3])]
        await settle()
        assert len(room) == 3
        room.wake(5)  # the first (4) fits, the second (2) would not beside it: it stays first
        await settle()
        assert done == [0] and len(room) == 2
        room.wake(1)  # not enough for the head: nobody behind it jumps the queue
        await settle()
        assert done == [0]
        room.wake(5)
        await asyncio.gather(*tasks)
        return done

    assert asyncio.run(run()) == [0, 1, 2]


def test_a_waiter_that_timed_out_leaves_the_queue():
    async def run() -> None:
        room = RoomWaiters()
        await room.wait(3, 0.01)  # nobody woke it: it returns at its timeout
        late = asyncio.create_task(room.wait(2, 5.0))
        await settle()
        room.wake(2)  # the timed-out head is skipped, the next one fits
        await asyncio.wait_for(late, 1.0)
        assert len(room) == 0

    asyncio.run(run())
