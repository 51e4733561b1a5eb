"""The host-memory KV tier through real processes: prefill and decode workers with small pools
and `--kv-host-cache-gb`, behind a gateway that prefills every prompt on the prefill worker.

A prompt is served, other prompts push its blocks out of both pools, and the prompt again
gives the same completion with its prefix copied back from the workers' host tiers (their
/metrics count host-tier hits and the blocks moved each way); no KV block is left held. Under
`tandem up --restart`, a decode worker killed while preemptions move blocks between its tiers
is restarted and every stream resumes there token for token.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.cluster import start_cluster
from tests.integration.stages import pipeline_stages, running
from tests.integration.test_resume import MAX_TOKENS, PROMPTS, _req, _Stream, _tokens
from tests.integration.test_up_restart import _stage_pids

WORKER = ["--num-blocks", "24", "--kv-host-cache-gb", "0.02"]
PROMPT = list(range(100, 200))  # 100 tokens: 6 full blocks of 16
OTHERS = [list(range(1000 + 100 * i, 1100 + 100 * i)) for i in range(4)]  # 7 blocks each


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("host-tier"))
    stages = pipeline_stages(
        d, [], gateway_args=["--disagg-threshold", "0"], prefill_args=WORKER, decode_args=WORKER
    )
    with running(*stages):
        yield stages


def _complete(gw, prompt: list[int]) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", gw.http_port, timeout=120)
    try:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        payload = json.loads(resp.read())
        assert resp.status == 200, payload
        return payload["choices"][0]["text"]
    finally:
        conn.close()


def _metrics(stage) -> dict[tuple[str, tuple], float]:
    return _metrics_at(f"http://127.0.0.1:{stage.metrics_port}/metrics")


def test_a_prefix_pushed_out_of_both_pools_comes_back_from_the_host_tiers(stack):
    prefill, decode, gateway = stack
    first = _complete(gateway, PROMPT)
    for p in OTHERS:
        _complete(gateway, p)
    again = _complete(gateway, PROMPT)
    assert again == first
    for stage in (prefill, decode):
        m = _metrics(stage)
        host_hits = m[("tandem_prefix_cache_hits_tokens_total", (("tier", "host"),))]
        to_device = m[("tandem_kv_tier_moved_blocks_total", (("direction", "to_device"),))]
        to_host = m[("tandem_kv_tier_moved_blocks_total", (("direction", "to_host"),))]
        assert host_hits == 6 * 16, (stage.name, host_hits)
        assert to_device == 6 and to_host >= 6, (stage.name, to_device, to_host)
        assert m[("tandem_kv_host_tier_blocks", ())] > 0
        st = stage.stats()
        assert st.prefix_host_hit_tokens == 6 * 16 and st.prefix_hit_tokens >= 6 * 16
        assert 0 < st.host_tier_blocks <= st.host_tier_capacity_blocks
    # Nothing is left held on either worker (cached blocks nobody holds are free).
    deadline = time.monotonic() + 20
    for stage in (prefill, decode):
        while True:
            used = _metrics(stage)[("tandem_kv_cache_usage_ratio", ())]
            if used == 0.0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert used == 0.0, stage.name


def test_streams_survive_a_decode_worker_killed_while_it_moves_blocks(model_factory):
    """Four long greedy streams in a pool that holds only two of them: the decode worker
    preempts, its host tier takes the preempted blocks and gives them back. Killed mid-run
    (copies between the tiers under way), it is restarted with an empty tier, the gateway
    resumes every stream there, and each ends with the tokens it gives alone."""
    _, path = model_factory("llama")
    tier = ["--num-blocks", "64", "--kv-host-cache-gb", "0.002", "--max-num-seqs", "4"]
    c = start_cluster(["--model", path, *tier, "--restart"])
    try:
        stub = c.gateway()
        want = [_tokens(stub.Generate(_req(p), timeout=120))[0] for p in PROMPTS]
        streams = [_Stream(stub, p) for p in PROMPTS]
        for s in streams:
            s.start()
        deadline = time.monotonic() + 120
        moved = 0.0
        while moved == 0.0 and time.monotonic() < deadline:
            m = _metrics_at(c.metrics_url("decode"))
            moved = m.get(("tandem_kv_tier_moved_blocks_total", (("direction", "to_device"),)), 0)
            time.sleep(0.05)
        assert moved > 0, "the decode worker never copied a block back from its host tier"
        decode_pid = _stage_pids(c.proc.pid)["decode"]
        os.kill(decode_pid, signal.SIGKILL)
        at_kill = [len(s.tokens) for s in streams]
        for s in streams:
            s.join(300)
        assert any(n < MAX_TOKENS for n in at_kill), at_kill
        for i, s in enumerate(streams):
            assert s.error is None, (i, s.error)
            assert s.finish is not None and s.finish.finish_reason == "length", (i, s.finish)
            assert s.tokens == want[i], f"stream {i} differs after resuming"
        assert _decode_pid(c.proc.pid, 30) not in (None, decode_pid), "not restarted"
        st = c.wait_decode_idle(30)
        assert st.used_blocks == 0 and st.running == 0
    finally:
        c.stop()


def _decode_pid(up_pid: int, within: float) -> int | None:
    """The pid of `tandem up`'s decode worker, waiting up to `within` s for one to run."""
    deadline = time.monotonic() + within
    while (pid := _stage_pids(up_pid).get("decode")) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return pid


def _metrics_at(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
