"""Turns a scheduled batch into packed tensors, runs the model, and returns last-token logits."""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from tandem.engine.cuda_graphs import DecodeGraphs, PendingIds, write_pending_ids
from tandem.engine.prompt_logprobs import PromptScoring
from tandem.engine.sequence import Sequence
from tandem.host_copy import device_tensor, to_device
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
        """Pack the new tokens of every sequence; (input_ids, positions, attention metadata).

        Built in numpy, in one host buffer: a loaded step holds hundreds of sequences, and
        per-token Python (and a tensor built from a list) cost milliseconds the device waits.
        """
        bs = self.block_size
        b = len(items)
        start_l = [s.num_computed for s, _ in items]
        starts = np.array(start_l, np.int64)
        counts = np.fromiter((n for _, n in items), np.int64, b)
        ctx = starts + counts
        qsl = np.zeros(b + 1, np.int64)
        np.cumsum(counts, out=qsl[1:])
        t = int(qsl[-1])
        nblocks = (ctx + bs - 1) // bs
        width = int(nblocks.max())
        decode_only = t == b
        # Each input starts on a 128-byte boundary, like a tensor of its own.
        sizes = [t, t, t, b, b * width]
        if not decode_only:
            # The varlen attention kernel's offsets, int32, two to a word.
            sizes += [(b + 2) // 2, (b + 1) // 2]
        offs = [0]
        for n in sizes:
            offs.append(offs[-1] + -(-n // _ALIGN) * _ALIGN)
        # Pinned on CUDA, so its copy is queued (see `tandem.host_copy`); zeros: padding entries
        # of the block tables point at block 0, which the context-length mask keeps out.
        host = torch.zeros(offs[-1], dtype=torch.long, pin_memory=self.device.type == "cuda")
        buf = host.numpy()
        ids, pos, slots = (buf[offs[i] : offs[i] + t] for i in range(3))
        buf[offs[3] : offs[3] + b] = ctx
        tables = buf[offs[4] : offs[4] + b * width].reshape(b, width)
        # Every row's blocks in one assignment, through the mask of the table's used entries.
        tables[np.arange(width) < nblocks[:, None]] = np.fromiter(
            chain.from_iterable(
                s.block_table.blocks[:nb]
                for (s, _), nb in zip(items, nblocks.tolist(), strict=True)
            ),
            np.int64,
            int(nblocks.sum()),
        )
        one: list[int] = []  # the token of each one-token row, in row order
        o = 0
        for (seq, n), a in zip(items, start_l, strict=True):
            if n == 1:
                # A token the device sampled but the host has not read yet (asynchronous
                # scheduling) is a placeholder; `write_pending_ids` fills it in on the device.
                prompt, out = seq.prompt_token_ids, seq.output_token_ids
                if a < len(prompt):
                    one.append(prompt[a])
                elif a - len(prompt) < len(out):
                    one.append(out[a - len(prompt)])
                elif seq.spec_tokens and a - len(prompt) - len(out) < len(seq.spec_tokens):
                    one.append(seq.spec_tokens[a - len(prompt) - len(out)])
                else:
                    one.append(0)
            else:
                toks = seq.step_token_ids[a : a + n]
                ids[o : o + len(toks)] = toks
            o += n
        if decode_only:
            ids[:] = one
            pos[:] = starts
            rows = np.arange(b)
        else:
            if one:
                ids[qsl[:-1][counts == 1]] = one
            rows = np.repeat(np.arange(b), counts)
            np.subtract(np.arange(t), np.repeat(qsl[:-1] - starts, counts), out=pos)
        np.add(tables[rows, pos // bs] * bs, pos % bs, out=slots)
        if not decode_only:
            buf[offs[5] : offs[5] + (b + 2) // 2].view(np.int32)[: b + 1] = qsl
            buf[offs[6] : offs[6] + (b + 1) // 2].view(np.int32)[:b] = ctx
        dev = to_device(host, self.device)
        ids_d, pos_d, slots_d, ctx_d, tables_d, *offsets = (
            dev[a : a + n] for a, n in zip(offs, sizes, strict=False)
        )
        meta = AttentionMetadata(
            slot_mapping=slots_d,
            block_tables=tables_d.view(b, width),
            context_lens=ctx_d,
            context_lens_list=ctx.tolist(),
            query_start_loc=qsl.tolist(),
            decode_only=decode_only,
        )
        if offsets:
            qsl_words, ctx_words = offsets
            meta.varlen_offsets = (
                qsl_words.view(torch.int32)[: b + 1],
                ctx_words.view(torch.int32)[:b],
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
