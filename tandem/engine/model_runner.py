"""Turns a scheduled batch into packed tensors, runs the model, and returns last-token logits."""

from __future__ import annotations

import numpy as np
import torch

from tandem.engine.cuda_graphs import DecodeGraphs, PendingIds, write_pending_ids
from tandem.engine.prompt_logprobs import PromptScoring
from tandem.engine.sequence import Sequence
from tandem.host_copy import device_tensor
from tandem.kv.cache import KVCache
from tandem.model.llama import AttentionMetadata, LlamaModel

# Each packed step input starts at a multiple of this many int64s (128 bytes).
_ALIGN = 16


class ModelRunner:
    """Owns the model and the KV pool tensor of one worker.

    With `cuda_graphs` (CUDA) decode batches of up to `max_num_seqs` sequences replay captured
    graphs, for every KV dtype (an FP8 / INT8 pool's decode write is one fused launch with no
    host synchronisation); prefill, mixed and verification batches run eagerly.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv: KVCache,
        cuda_graphs: bool = False,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.device = model.device
        self.block_size = kv.block_size
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(
                model, kv, max_num_seqs, max_model_len or model.max_positions
            )
            self.graphs.capture_all()

    def prepare(
        self, items: list[tuple[Sequence, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Pack the new tokens of every sequence; (input_ids, positions, attention metadata)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        ctx: list[int] = []
        tables: list[list[int]] = []
        for seq, n in items:
            start = seq.num_computed
            toks = seq.step_token_ids[start : start + n]
            # A token the device sampled but the host has not read yet (asynchronous scheduling)
            # is a placeholder here; `write_pending_ids` fills it in on the device.
            ids.extend(toks if len(toks) == n else toks + [0] * (n - len(toks)))
            pos.extend(range(start, start + n))
            blocks = seq.block_table.blocks
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            qsl.append(qsl[-1] + n)
            ctx.append(start + n)
            tables.append(blocks[: (start + n + bs - 1) // bs])
        width = max(len(t) for t in tables)
        # Padding entries point at block 0; the context-length mask keeps them out of attention.
        flat = [b for t in tables for b in (t + [0] * (width - len(t)))]
        decode_only = len(ids) == len(items)
        parts: list[list[int]] = [ids, pos, slots, ctx, flat]
        if not decode_only:
            # The varlen attention kernel's offsets, int32, two to a word.
            parts += [_int32_words(qsl), _int32_words(ctx)]
        # One host tensor and one queued copy for all inputs (a copy from a Python list would
        # synchronize the stream: see `tandem.host_copy`); each input is a slice of it,
        # starting on a 128-byte boundary like a tensor of its own.
        starts = []
        packed: list[int] = []
        for part in parts:
            starts.append(len(packed))
            packed.extend(part)
            packed.extend([0] * (-len(packed) % _ALIGN))
        dev = device_tensor(packed, torch.long, self.device)
        ids_d, pos_d, slots_d, ctx_d, flat_d, *offsets = (
            dev[a : a + len(part)] for a, part in zip(starts, parts, strict=True)
        )
        meta = AttentionMetadata(
            slot_mapping=slots_d,
            block_tables=flat_d.view(len(tables), width),
            context_lens=ctx_d,
            context_lens_list=ctx,
            query_start_loc=qsl,
            decode_only=decode_only,
        )
        if offsets:
            qsl_words, ctx_words = offsets
            meta.varlen_offsets = (
                qsl_words.view(torch.int32)[: len(qsl)],
                ctx_words.view(torch.int32)[: len(ctx)],
            )
        return ids_d, pos_d, meta

    @torch.inference_mode()
    def execute(
        self,
        items: list[tuple[Sequence, int]],
        num_logits: list[int] | None = None,
        pending: PendingIds | None = None,
        scoring: PromptScoring | None = None,
    ) -> torch.Tensor:
        """Compute the new tokens' KV and return logits at each sequence's last positions.

        `num_logits[i]`: how many trailing positions of sequence i need logits (1 + its draft
        tokens when verifying); default one each. Rows come sequence by sequence, in order.
        `pending`: input tokens still on the device, sampled by the step in flight.
        `scoring`: prompt positions whose logprobs are computed too (into `scoring.results`).
        A decode batch on CUDA graphs returns a view that the next replay overwrites.
        """
        if (
            self.graphs is not None
            and scoring is None
            and all(n == 1 for _, n in items)
            and (num_logits is None or all(m == 1 for m in num_logits))
            and self.graphs.bucket_for(len(items)) is not None
        ):
            return self.graphs.run(items, pending)
        input_ids, positions, meta = self.prepare(items)
        write_pending_ids(input_ids, pending)
        hidden = self.model.forward(input_ids, positions, self.kv, meta)
        if scoring is not None:
            scoring.compute(self.model.logits, hidden)
        if num_logits is not None and any(m != 1 for m in num_logits):
            rows = [
                r
                for end, m in zip(meta.query_start_loc[1:], num_logits, strict=True)
                for r in range(end - m, end)
            ]
            hidden = hidden[device_tensor(rows, torch.long, self.device)]
        elif not meta.decode_only:
            last = [end - 1 for end in meta.query_start_loc[1:]]
            hidden = hidden[device_tensor(last, torch.long, self.device)]
        return self.model.logits(hidden)


def _int32_words(values: list[int]) -> list[int]:
    """`values` as int32s, two to an int64 word (little-endian, as the device reads a view of
    the words as int32)."""
    a = np.zeros(len(values) + len(values) % 2, dtype="<i4")
    a[: len(values)] = values
    return a.view("<i8").tolist()
