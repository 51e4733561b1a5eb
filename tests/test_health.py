"""grpc.health.v1 as the services register it: NOT_SERVING until the service says otherwise."""

from __future__ import annotations

import asyncio

import grpc

from tandem.rpc.health import add_health, check, set_serving


def test_a_new_server_is_not_serving_until_it_says_so():
    async def main() -> list[bool]:
        server = grpc.aio.server()
        servicer = await add_health(server, ["tandem.v1.Gateway"])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            addr = f"127.0.0.1:{port}"
            seen = [await check(addr)]  # up and listening, not yet ready
            await set_serving(servicer, ["tandem.v1.Gateway"], True)
            seen.append(await check(addr))
            await set_serving(servicer, ["tandem.v1.Gateway"], False)
            seen.append(await check(addr))
            return seen
        finally:
            await server.stop(None)

    assert asyncio.run(main()) == [False, True, False]
