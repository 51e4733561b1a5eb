"""Draft worker: proposes tokens for speculative decoding (n-gram lookup or a small model)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

import grpc

from tandem import telemetry
from tandem.config import EngineConfig
from tandem.engine.proposers import ModelProposer, NgramProposer, build_proposer
from tandem.model.llama import LlamaModel
from tandem.model.loader import load_model, load_model_info
from tandem.model.tokenizer import Tokenizer
from tandem.rpc import stages_pb2, stages_pb2_grpc
from tandem.rpc.health import add_health, set_serving

log = logging.getLogger("tandem.draft")
SERVICE = "tandem.v1.Draft"


def tokenizer_differences(target: Tokenizer, draft: Tokenizer) -> list[str]:
    """What makes two tokenizers disagree (empty when the draft may propose for the target)."""
    diffs = []
    tv, dv = target.hf.get_vocab(), draft.hf.get_vocab()
    if tv != dv:
        only_t = len(set(tv) - set(dv))
        only_d = len(set(dv) - set(tv))
        moved = sum(1 for k in set(tv) & set(dv) if tv[k] != dv[k])
        diffs.append(
            f"vocabularies differ ({len(tv)} vs {len(dv)} tokens; {only_t} only in the target, "
            f"{only_d} only in the draft, {moved} with different ids)"
        )
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target.hf, name, None), getattr(draft.hf, name, None)
        if a != b:
            diffs.append(f"{name}: {a} in the target, {b} in the draft")
    ts = dict(zip(target.hf.all_special_tokens, target.hf.all_special_ids, strict=False))
    ds = dict(zip(draft.hf.all_special_tokens, draft.hf.all_special_ids, strict=False))
    if ts != ds:
        diffs.append(
            f"special tokens differ: target {sorted(ts.items())}, draft {sorted(ds.items())}"
        )
    return diffs


def make_proposer(spec: str, config: EngineConfig, num_blocks: int):
    """Build the proposer named by --draft: ngram, self:N, or a path to a smaller model."""
    if spec == "ngram":
        return NgramProposer()
    if spec.startswith("self:"):
        loaded = load_model(config.model, config.resolved_dtype())
        return build_proposer(spec, loaded, config, num_blocks)
    target_cfg, target_tok, _ = load_model_info(config.model)
    draft = load_model(spec, config.resolved_dtype())
    diffs = tokenizer_differences(target_tok, draft.tokenizer)
    if draft.config.vocab_size != target_cfg.vocab_size:
        diffs.insert(
            0,
            f"vocab_size: {target_cfg.vocab_size} in the target, {draft.config.vocab_size} in the draft",
        )
    if diffs:
        raise ValueError(f"draft model {spec!r} cannot propose for the target: " + "; ".join(diffs))
    model = LlamaModel(
        draft.config, draft.weights, config.resolved_dtype(), config.resolved_device()
    )
    return ModelProposer(model, num_blocks, config.block_size)


class DraftService(stages_pb2_grpc.DraftServicer):
    def __init__(self, proposer, kind: str = "") -> None:
        self.proposer = proposer
        self.kind = kind
        self.links: dict = {}  # seq_id -> link to its draft.admit span (tracing on)
        # One thread owns the proposer: calls never overlap, the event loop never blocks.
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tandem-draft")
        self.proposals = 0

    async def _run(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    async def Admit(self, request, context):
        sid, ids = request.seq_id, list(request.prompt_token_ids)
        t0 = time.monotonic()

        def admit():
            self.proposer.drop(sid)
            self.proposer.sync(sid, 0, ids)
            warm = getattr(self.proposer, "prefill", None)
            if warm is not None:
                warm(sid)

        await self._run(admit)
        if telemetry.enabled():
            parent = telemetry.extract(telemetry.metadata_carrier(context.invocation_metadata()))
            if parent is not None:
                # The draft's prefill is a child of the request; each propose step links to it.
                span = telemetry.record_span(
                    "draft.admit",
                    parent,
                    t0,
                    time.monotonic(),
                    {"tandem.draft.prompt_tokens": len(ids), "tandem.draft.proposer": self.kind},
                )
                link = telemetry.link_to(span)
                if link is not None:
                    self.links[sid] = link
        return stages_pb2.DraftAdmitResponse()

    def _step(self, req: stages_pb2.ProposeRequest) -> stages_pb2.ProposeResponse:
        t0 = time.monotonic()
        for sid in req.dropped:
            self.proposer.drop(sid)
            self.links.pop(sid, None)
        ks, unknown = {}, []
        for s in req.seqs:
            if self.proposer.sync(s.seq_id, s.start, list(s.tokens)):
                ks[s.seq_id] = s.k
            else:
                unknown.append(s.seq_id)
        props = self.proposer.propose(ks)
        self.proposals += sum(len(v) for v in props.values())
        out = stages_pb2.ProposeResponse(step=req.step)
        for sid in ks:
            out.proposals.append(
                stages_pb2.DraftProposal(seq_id=sid, known=True, tokens=props.get(sid, []))
            )
        for sid in unknown:
            out.proposals.append(stages_pb2.DraftProposal(seq_id=sid, known=False))
        links = [self.links[sid] for sid in ks if sid in self.links]
        if links:
            # One span per propose step for the whole batch, linked to the requests it served.
            telemetry.record_batch_span(
                "draft.propose",
                t0,
                time.monotonic(),
                {
                    "tandem.draft.sequences": len(ks),
                    "tandem.draft.proposed_tokens": sum(len(v) for v in props.values()),
                    "tandem.draft.proposer": self.kind,
                },
                links,
            )
        return out

    async def Propose(self, request_iterator, context):
        async for req in request_iterator:
            yield await self._run(lambda r=req: self._step(r))

    async def Stats(self, request, context):
        return stages_pb2.WorkerStats(running=self.proposer.num_seqs)


async def serve(
    config: EngineConfig,
    host: str,
    port: int,
    draft: str = "ngram",
    num_blocks: int = 4096,
    metrics_port: int | None = None,
) -> None:
    """Run the draft worker until cancelled."""
    proposer = make_proposer(draft, config, num_blocks)
    server = grpc.aio.server()
    service = DraftService(proposer, draft)
    stages_pb2_grpc.add_DraftServicer_to_server(service, server)
    health = add_health(server, [SERVICE])
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"draft: cannot bind {host}:{port}")
    await server.start()
    await set_serving(health, [SERVICE], True)
    log.info("draft serving on %s:%d (proposer %s)", host, bound, draft)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(1.0)
        service.pool.shutdown(wait=False)
