"""The engine's packed step inputs, checked slice by slice against values worked out from the
sequences, for batches that mix prompt chunks and decodes."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tandem.api.sampling_params import SamplingParams
from tandem.engine.cuda_graphs import write_pending_ids
from tandem.engine.model_runner import ModelRunner
from tandem.engine.sequence import Sequence
from tandem.kv.block_pool import BlockPool
from tandem.kv.block_table import BlockTable

BS = 16


def _runner() -> ModelRunner:
    model = SimpleNamespace(device=torch.device("cpu"))
    return ModelRunner(model, SimpleNamespace(block_size=BS))


def _seq(pool: BlockPool, name: str, prompt: int, outputs: int, computed: int) -> Sequence:
    seq = Sequence(name, list(range(1000, 1000 + prompt)), SamplingParams(), BlockTable(BS))
    seq.output_token_ids = list(range(5000, 5000 + outputs))
    seq.num_computed = computed
    # Blocks taken from a pool shared with the other sequences: not in order, not from 0.
    seq.block_table.ensure(pool, seq.num_tokens)
    return seq


def _batch(pool: BlockPool) -> list[tuple[Sequence, int]]:
    pool.allocate(3)  # the sequences' blocks do not start at block 0
    return [
        (_seq(pool, "decode", 20, 3, 22), 1),  # one new token, the last output
        (_seq(pool, "whole prompt", 37, 0, 0), 37),
        (_seq(pool, "chunk mid-prompt", 70, 0, 16), 24),  # tokens 16..39 of 70
        (_seq(pool, "decode, one block", 5, 1, 5), 1),
    ]


def test_each_input_is_what_its_sequences_say():
    runner = _runner()
    items = _batch(BlockPool(64))
    ids, pos, meta = runner.prepare(items)
    want_ids, want_pos, want_slots, want_ctx, want_tables = [], [], [], [], []
    for seq, n in items:
        start = seq.num_computed
        tokens = seq.prompt_token_ids + seq.output_token_ids
        blocks = seq.block_table.blocks
        for p in range(start, start + n):
            want_ids.append(tokens[p])
            want_pos.append(p)
            want_slots.append(blocks[p // BS] * BS + p % BS)
        want_ctx.append(start + n)
        want_tables.append(blocks[: -(-(start + n) // BS)])
    assert ids.tolist() == want_ids
    assert pos.tolist() == want_pos
    assert meta.slot_mapping.tolist() == want_slots
    assert meta.context_lens.tolist() == want_ctx
    assert meta.context_lens_list == want_ctx
    width = max(len(t) for t in want_tables)
    assert meta.block_tables.shape == (len(items), width)
    for row, t in zip(meta.block_tables.tolist(), want_tables, strict=True):
        assert row == t + [0] * (width - len(t))
    assert meta.query_start_loc == [0, 1, 38, 62, 63]
    assert not meta.decode_only
    # The varlen kernel's offsets: the same values, int32.
    qs, cl = meta.varlen_offsets
    assert qs.dtype == cl.dtype == torch.int32
    assert qs.tolist() == [0, 1, 38, 62, 63] and cl.tolist() == want_ctx
    assert qs.storage_offset() * 4 % 128 == 0 and cl.storage_offset() * 4 % 128 == 0
    for t in (ids, pos, meta.slot_mapping, meta.context_lens, meta.block_tables):
        assert t.dtype == torch.long and t.is_contiguous()
        # Kernels see each input start on a 128-byte boundary, as a tensor of its own would.
        assert t.storage_offset() % 16 == 0


def test_inputs_do_not_share_elements():
    """The inputs are slices of one tensor: writing one (pending ids are written into the ids
    on the device) leaves the others as they were."""
    runner = _runner()
    ids, pos, meta = runner.prepare(_batch(BlockPool(64)))
    inputs = (pos, meta.slot_mapping, meta.context_lens, meta.block_tables, *meta.varlen_offsets)
    others = [t.clone() for t in inputs]
    ids.fill_(-7)
    after = inputs
    for a, b in zip(after, others, strict=True):
        assert torch.equal(a, b)


def test_a_decode_batch_is_decode_only():
    runner = _runner()
    pool = BlockPool(64)
    items = [(_seq(pool, f"s{i}", 10 + 7 * i, 2, 11 + 7 * i), 1) for i in range(5)]
    ids, pos, meta = runner.prepare(items)
    assert meta.decode_only and meta.varlen_offsets is None  # the decode kernel needs none
    assert ids.tolist() == [5001] * 5
    assert pos.tolist() == [11 + 7 * i for i in range(5)]


def test_pending_ids_of_a_changed_batch_go_to_their_rows():
    """Row i of this step takes the id the step in flight sampled in row prev_rows[i]."""
    input_ids = torch.arange(100, 106)
    prev_ids = torch.tensor([7, 8, 9, 10])
    rows, prev_rows = [1, 4, 5], [2, 0, 3]
    write_pending_ids(input_ids, (rows, prev_rows, prev_ids))
    assert input_ids.tolist() == [100, 9, 102, 103, 7, 10]


def test_pending_ids_of_the_same_batch():
    input_ids = torch.arange(100, 104)
    write_pending_ids(input_ids, ([0, 1, 2], [0, 1, 2], torch.tensor([7, 8, 9, 10])))
    assert input_ids.tolist() == [7, 8, 9, 103]
