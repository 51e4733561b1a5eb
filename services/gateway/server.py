"""Gateway process: public gRPC (with reflection and health) and OpenAI-compatible HTTP."""

from __future__ import annotations

import logging

import grpc
from aiohttp import web
from grpc_reflection.v1alpha import reflection

from services.gateway.grpc_api import Frontend, GatewayService
from services.gateway.http_api import OpenAIServer
from services.gateway.pipeline import Pipeline
from services.gateway.router import Router
from tandem.config import EngineConfig
from tandem.model.loader import load_model_info
from tandem.rpc import api_pb2, api_pb2_grpc
from tandem.rpc.health import add_health, set_serving

log = logging.getLogger("tandem.gateway")
SERVICE = "tandem.v1.Gateway"


async def serve(
    config: EngineConfig,
    host: str,
    port: int,
    http_port: int | None,
    prefill: list[str],
    decode: list[str],
) -> None:
    """Run the gateway until cancelled."""
    mc, tokenizer, _ = load_model_info(config.model)
    max_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    router = Router(prefill, decode)
    eos = set(mc.eos_token_ids) | set(tokenizer.eos_token_ids)
    pipeline = Pipeline(router, tokenizer, eos, max_len)
    frontend = Frontend(pipeline, mc.name, mc.vocab_size)

    server = grpc.aio.server()
    api_pb2_grpc.add_GatewayServicer_to_server(GatewayService(frontend), server)
    health = add_health(server, [SERVICE])
    names = (
        api_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name,
        reflection.SERVICE_NAME,
        "grpc.health.v1.Health",
    )
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gateway: cannot bind {host}:{port}")
    await server.start()
    runner = None
    if http_port is not None:
        runner = web.AppRunner(OpenAIServer(frontend).app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, http_port).start()
    await set_serving(health, [SERVICE], True)
    log.info(
        "gateway serving gRPC on %s:%d, HTTP on %s (model %s)", host, bound, http_port, mc.name
    )
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(1.0)
        if runner is not None:
            await runner.cleanup()
        await router.close()
