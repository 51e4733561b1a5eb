"""Draft worker: proposes tokens for speculative decoding (n-gram lookup or a small model)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

from tandem import progress, telemetry
from tandem.config import EngineConfig
from tandem.engine.proposers import build_proposer
from tandem.loop_lag import LoopLag
from tandem.metrics import DraftMetrics, serve_metrics
from tandem.model.info import context_length, load_model_info
from tandem.rpc import stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import StageCredentials, add_stage_port, stage_server, tls_words
from tandem.rpc.health import add_health, set_serving
from tandem.rpc.limits import draft_limits

log = logging.getLogger("tandem.draft")
SERVICE = "tandem.v1.Draft"


class DraftService(stages_pb2_grpc.DraftServicer):
    def __init__(self, proposer, kind: str = "") -> None:
        self.proposer = proposer
        self.kind = kind
        self.links: dict = {}  # seq_id -> link to its draft.admit span (tracing on)
        # One thread owns the proposer: calls never overlap, the event loop never blocks.
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tandem-draft")
        self.proposals = 0
        model = getattr(proposer, "model", None)  # a draft model's GPU gets its gauges
        self.metrics = DraftMetrics(
            lambda: self.proposer.num_seqs, device=getattr(model, "device", None)
        )

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
        n = sum(len(v) for v in props.values())
        self.proposals += n
        self.metrics.proposed_tokens.inc(n)
        self.metrics.steps.inc()
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
    num_blocks: int | None = None,
    metrics_port: int | None = None,
    stage_credentials: StageCredentials | None = None,
    metrics_token: bytes | None = None,
) -> None:
    """Run the draft worker until cancelled.

    `draft`: ngram, self:N, self-int4, self-int4:DIR or a model path (tandem.engine.draft_models);
    a draft model's KV pool holds `num_blocks` blocks (default: --num-blocks, else what
    --kv-cache-memory-gb holds, 1 GiB when unset).
    With a stage secret in `stage_credentials`, every call but health checks must carry it (or,
    for Admit and Stats, the gateway secret); with a certificate there, the port serves TLS only
    (tandem.rpc.auth). Prometheus text on `metrics_port` (None: off), to scrapes that carry
    `metrics_token` when given.
    """
    proposer = build_proposer(draft, config, num_blocks=num_blocks)
    creds = stage_credentials or StageCredentials()
    service = DraftService(proposer, draft)
    # The prompts are the target's: its context length bounds every sequence proposed for.
    max_len = context_length(
        config.max_model_len, load_model_info(config.model)[0].max_position_embeddings
    )
    server = stage_server(
        creds,
        draft_limits(max_len, config.max_num_seqs),
        lambda reason: service.metrics.refusals.labels(reason).inc(),
    )
    stages_pb2_grpc.add_DraftServicer_to_server(service, server)
    health = await add_health(server, [SERVICE])
    bound = add_stage_port(server, f"{host}:{port}", creds)
    if bound == 0:
        raise OSError(f"draft: cannot bind {host}:{port}")
    await server.start()
    try:
        metrics = serve_metrics(
            service.metrics.registry, host, metrics_port, "draft", metrics_token
        )
    except OSError:
        await server.stop(None)
        service.pool.shutdown(wait=False)
        raise
    lag = LoopLag(service.metrics.registry)
    lag.start()
    await set_serving(health, [SERVICE], True)
    progress.report("ready")
    log.info("draft serving on %s:%d%s (proposer %s)", host, bound, tls_words(creds), draft)
    try:
        await server.wait_for_termination()
    finally:
        try:
            await server.stop(1.0)  # may itself be cancelled (SIGTERM): shut down anyway
        finally:
            lag.stop()
            service.pool.shutdown(wait=False)
            if metrics is not None:
                metrics.close()
