"""Draft-token proposers for speculative decoding: n-gram prompt lookup and a draft model.

Both propose deterministically (q is one-hot), which `spec_decode.accept_draft_tokens` assumes.
Each keeps per-sequence state that the decode worker keeps in step: `sync(seq, start, tokens)`
says "your first `start` tokens are right; these follow", which also rolls back rejected drafts.
"""

from __future__ import annotations

import torch

from tandem.api.sampling_params import SamplingParams
from tandem.engine.model_runner import ModelRunner
from tandem.engine.sequence import Sequence
from tandem.kv.block_pool import BlockPool
from tandem.kv.block_table import BlockTable
from tandem.kv.cache import KVCache
from tandem.model.llama import LlamaModel


def ngram_lookup(tokens: list[int], k: int, n_max: int = 4, n_min: int = 1) -> list[int]:
    """Match the last n (n_max down to n_min) tokens earlier in the sequence; propose what followed."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        tail = tokens[size - n :]
        first = tail[0]
        # The most recent earlier occurrence is the likeliest to repeat.
        for i in range(size - n - 1, -1, -1):
            if tokens[i] == first and tokens[i : i + n] == tail:
                cont = tokens[i + n : i + n + k]
                if cont:
                    return cont
    return []


class NgramProposer:
    """Prompt lookup: no model, proposals come from the sequence itself."""

    name = "ngram"

    def __init__(self, n_max: int = 4, n_min: int = 1) -> None:
        self.n_max, self.n_min = n_max, n_min
        self.seqs: dict[str, list[int]] = {}

    def sync(self, seq_id: str, start: int, tokens: list[int]) -> bool:
        """Keep the first `start` known tokens, append `tokens`; False when we lack that prefix."""
        cur = self.seqs.get(seq_id)
        if cur is None:
            if start != 0:
                return False
            cur = self.seqs[seq_id] = []
        if len(cur) < start:
            return False
        del cur[start:]
        cur.extend(tokens)
        return True

    def propose(self, ks: dict[str, int]) -> dict[str, list[int]]:
        return {
            sid: ngram_lookup(self.seqs[sid], k, self.n_max, self.n_min)
            for sid, k in ks.items()
            if sid in self.seqs and k > 0
        }

    def drop(self, seq_id: str) -> None:
        self.seqs.pop(seq_id, None)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)


class ModelProposer:
    """A small model (or the target's first layers) decoding greedily over its own paged KV."""

    name = "model"

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int = 16) -> None:
        cfg = model.cfg
        self.model = model
        self.kv = KVCache.allocate(
            cfg.num_layers,
            num_blocks,
            block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            model.dtype,
            model.device,
        )
        self.pool = BlockPool(num_blocks)
        self.runner = ModelRunner(model, self.kv)
        self.block_size = block_size
        self.seqs: dict[str, Sequence] = {}
        self._greedy = SamplingParams(temperature=0.0)

    def sync(self, seq_id: str, start: int, tokens: list[int]) -> bool:
        seq = self.seqs.get(seq_id)
        if seq is None:
            if start != 0:
                return False
            seq = Sequence(seq_id, [], self._greedy, BlockTable(self.block_size))
            self.seqs[seq_id] = seq
        cur = seq.prompt_token_ids
        if len(cur) < start:
            return False
        # KV stays valid for the known prefix and for old tokens the new ones repeat
        # (accepted drafts were computed when they were proposed).
        old = cur[start:]
        match = 0
        while match < min(len(old), len(tokens)) and old[match] == tokens[match]:
            match += 1
        del cur[start:]
        cur.extend(tokens)
        seq.num_computed = min(seq.num_computed, start + match, len(cur))
        return True

    @torch.inference_mode()
    def propose(self, ks: dict[str, int]) -> dict[str, list[int]]:
        """Greedy-decode up to k tokens for each sequence, batched across sequences."""
        want = {sid: k for sid, k in ks.items() if sid in self.seqs and k > 0}
        out: dict[str, list[int]] = {sid: [] for sid in want}
        active = list(want)
        for _ in range(max(want.values(), default=0)):
            items = []
            for sid in active:
                seq = self.seqs[sid]
                n = seq.num_tokens - seq.num_computed
                if n <= 0 or not self.pool.can_allocate(
                    seq.block_table.blocks_needed(seq.num_tokens)
                ):
                    continue
                seq.block_table.ensure(self.pool, seq.num_tokens)
                items.append((seq, n))
            if not items:
                break
            logits = self.runner.execute(items)
            toks = logits.argmax(dim=-1).tolist()
            nxt = []
            for (seq, n), tok in zip(items, toks, strict=True):
                seq.num_computed += n
                seq.prompt_token_ids.append(tok)
                out[seq.seq_id].append(tok)
                if len(out[seq.seq_id]) < want[seq.seq_id]:
                    nxt.append(seq.seq_id)
            active = nxt
        return out

    @torch.inference_mode()
    def prefill(self, seq_id: str) -> None:
        """Compute the KV of a newly admitted sequence now (all but its last token)."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            return
        n = seq.num_tokens - seq.num_computed - 1
        if n <= 0 or not self.pool.can_allocate(seq.block_table.blocks_needed(seq.num_tokens)):
            return
        seq.block_table.ensure(self.pool, seq.num_tokens)
        self.runner.execute([(seq, n)])
        seq.num_computed += n

    def drop(self, seq_id: str) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            seq.block_table.release(self.pool)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)


def build_proposer(
    spec: str, config, target=None, num_blocks: int | None = None
) -> NgramProposer | ModelProposer:
    """A proposer from its command-line name: "ngram", or a draft model ("self:N", "self-int4",
    "self-int4:DIR", a model path; see `tandem.engine.draft_models`).

    `config` is the target's `EngineConfig`; `target` its `LoadedModel` when already loaded.
    A draft model's KV pool has `num_blocks` blocks (default: `draft_num_blocks`).
    """
    from tandem.engine.draft_models import draft_num_blocks, load_draft_model

    if spec == "ngram":
        return NgramProposer()
    model = load_draft_model(spec, config, target)
    return ModelProposer(model, num_blocks or draft_num_blocks(model, config), config.block_size)
