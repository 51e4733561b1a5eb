"""The grammar pool against the default model's vocabulary: compiled grammars kept within the
cache's byte limit, and each budget (time, size, a busy pool) failing its request alone with an
error naming its setting; and a grammar's accepted tokens bounded by the prompt."""

from __future__ import annotations

import asyncio
import json

import pytest

from tandem.api.sampling_params import SamplingParams, StructuredOutput
from tandem.api.validation import validate_request
from tandem.engine.grammar import GrammarCompiler
from tandem.engine.grammar_pool import GrammarPool, GrammarPoolBusy
from tandem.model.info import load_model_info

pytest.importorskip("xgrammar")


def schema(properties: int, prefix: str = "p") -> StructuredOutput:
    """A JSON schema of an object with `properties` required string properties."""
    names = [f"{prefix}{i}" for i in range(properties)]
    return StructuredOutput(
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "properties": {n: {"type": "string"} for n in names},
                "required": names,
            }
        ),
    )


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    cfg, tok, _ = load_model_info()
    return GrammarCompiler(tok.hf, cfg.vocab_size, cfg.eos_token_ids, 256 << 20, 60.0)


def pool_of(compiler: GrammarCompiler, cache_bytes: int, timeout_s: float, threads: int = 2):
    return GrammarPool(compiler._compile, cache_bytes, timeout_s, threads)


def test_the_cache_stays_within_its_byte_limit(compiler):
    limit = 1 << 20
    pool = pool_of(compiler, limit, 60.0)
    sizes = []

    async def run() -> None:
        for k in range(30):
            g = await pool.compiled(schema(60, prefix=f"k{k}_"))
            sizes.append(g.memory_size_bytes)
            assert pool.cache_bytes <= limit
        again = await pool.compiled(schema(60, prefix="k29_"))  # the latest is still cached
        assert again.memory_size_bytes == sizes[-1]

    asyncio.run(run())
    assert sum(sizes) > 3 * limit, "the grammars were meant to outgrow the cache"
    st = pool.stats()
    assert st["outcomes"]["compiled"] == 30 and st["outcomes"]["cached"] == 1
    assert st["cache_bytes"] == pool.cache_bytes <= limit and st["compiling"] == 0
    assert 0 < st["cached"] < 30


def test_a_grammar_larger_than_the_cache_is_refused(compiler):
    pool = pool_of(compiler, 1 << 20, 60.0)
    with pytest.raises(ValueError, match=r"grammar_cache_mb=1\b"):
        asyncio.run(pool.compiled(schema(600)))
    assert pool.cache_bytes == 0 and pool.stats()["outcomes"]["too_large"] == 1


def test_a_slow_compile_fails_its_requests_alone(compiler):
    """Past its budget a compile fails every request waiting for it, and the same grammar asked
    again fails at once; a small grammar compiles meanwhile on the other thread."""
    pool = pool_of(compiler, 256 << 20, 0.5)
    big = schema(6000)

    async def run() -> None:
        with pytest.raises(ValueError, match=r"grammar_compile_timeout_s=0.5 s"):
            await asyncio.gather(pool.compiled(big), pool.compiled(big))
        assert pool.stats()["compiling"] == 1  # it runs on
        with pytest.raises(ValueError, match="grammar_compile_timeout_s"):
            await asyncio.wait_for(pool.compiled(big), 0.1)
        small = await pool.compiled(StructuredOutput("regex", "[0-9]{4}"))
        assert small.memory_size_bytes > 0

    asyncio.run(run())
    assert pool.stats()["outcomes"]["timeout"] == 3


def test_a_grammar_no_thread_starts_is_refused_as_busy(compiler):
    pool = pool_of(compiler, 256 << 20, 0.5, threads=1)

    async def run() -> None:
        slow = asyncio.ensure_future(pool.compiled(schema(6000)))
        await asyncio.sleep(0.05)  # the one thread has taken it
        with pytest.raises(GrammarPoolBusy, match="grammar_compile_timeout_s"):
            await pool.compiled(StructuredOutput("regex", "[a-z]+"))
        with pytest.raises(ValueError):
            await slow

    asyncio.run(run())
    assert pool.stats()["outcomes"]["busy"] == 1


@pytest.mark.parametrize(
    ("prompt", "accepted", "fragment"),
    [
        ([5, 6, 7, 9], [6, 7, 8], "last 3 tokens"),
        ([5, 6, 7], [5, 6, 7], "prompt has only 3"),
        ([5, 6, 7], [1] * 3_000_000, "holds 3000000 tokens"),
    ],
)
def test_accepted_tokens_must_end_the_prompt(prompt, accepted, fragment):
    params = SamplingParams(structured=StructuredOutput("regex", "[a-z]+", accepted))
    with pytest.raises(ValueError, match=fragment):
        validate_request(prompt, params, 100, 1000)
    ok = SamplingParams(structured=StructuredOutput("regex", "[a-z]+", prompt[1:]))
    validate_request(prompt, ok, 100, 1000)
