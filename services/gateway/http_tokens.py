"""vLLM's token endpoints: POST /tokenize (a prompt or chat messages -> token ids) and POST
/detokenize (token ids -> text), with the gateway's own tokenizer and chat template."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from services.gateway.grpc_api import Frontend
from services.gateway.openai_request import normalize_messages
from services.gateway.openai_wire import RequestError, refusal

TOKENIZE_FIELDS = frozenset(
    {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"}
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})

ReadBody = Callable[[web.Request, frozenset[str]], Awaitable[dict]]


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{name} must be a boolean, got {v!r}", name)
    return v


class TokenEndpoints:
    """The handlers; `read_body` reads a request's JSON object, refusing unknown fields."""

    def __init__(self, frontend: Frontend, read_body: ReadBody) -> None:
        self.fe = frontend
        self.read_body = read_body

    async def tokenize(self, request: web.Request) -> web.Response:
        """{prompt | messages, add_special_tokens?, add_generation_prompt?} -> {count,
        max_model_len, tokens}. A prompt gets the tokenizer's special tokens unless
        add_special_tokens is false; messages are rendered by the chat template (which places
        them), with the assistant's turn opened unless add_generation_prompt is false."""
        try:
            body = await self.read_body(request, TOKENIZE_FIELDS)
            self.fe.check_model(body.get("model") or "")
            if ("prompt" in body) == ("messages" in body):
                raise RequestError("send either prompt or messages (exactly one)", "prompt")
            if "prompt" in body:
                if "add_generation_prompt" in body:
                    raise RequestError(
                        "add_generation_prompt applies to messages only", "add_generation_prompt"
                    )
                prompt = body["prompt"]
                if not isinstance(prompt, str):
                    raise RequestError("prompt must be a string", "prompt")
                special = _flag(body, "add_special_tokens", True)
                ids = await self.fe.prompt_ids(prompt, add_special_tokens=special)
            else:
                if "add_special_tokens" in body:
                    raise RequestError(
                        "add_special_tokens applies to a prompt only (the chat template places "
                        "the special tokens of messages)",
                        "add_special_tokens",
                    )
                opened = _flag(body, "add_generation_prompt", True)
                msgs = normalize_messages(body["messages"], self.fe.limits.max_messages)
                ids = await self.fe.chat_ids(msgs, add_generation_prompt=opened)
        except ValueError as e:
            return refusal(e)
        return web.json_response(
            {"count": len(ids), "max_model_len": self.fe.pipeline.max_model_len, "tokens": ids}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        """{tokens} -> {prompt}: the text of the ids, special tokens skipped."""
        try:
            body = await self.read_body(request, DETOKENIZE_FIELDS)
            self.fe.check_model(body.get("model") or "")
            ids = body.get("tokens")
            vocab = self.fe.vocab_size
            most = self.fe.pipeline.max_model_len  # what one sequence of this model can hold
            if isinstance(ids, list) and len(ids) > most:
                raise RequestError(
                    f"tokens holds {len(ids)} ids; at most {most} (the model's context) are "
                    "decoded at once",
                    "tokens",
                )
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
            ):
                raise RequestError(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
        except ValueError as e:
            return refusal(e)
        return web.json_response({"prompt": self.fe.tokenizer.decode(ids)})
