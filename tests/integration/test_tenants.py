"""Tenants through real processes: API keys name tenants, quotas refuse with HTTP 429.

Prefill and decode workers run with tenant quotas (a: 10% of 64 blocks; b: the rest); one
gateway maps API keys to tenants, another takes `X-Tenant` from clients. A prompt tenant a's
quota can never hold is refused with 429 naming the quota, while b's same prompt is served; a
malformed tenant name is a 400, a wrong key a 401; the workers' /metrics carry the per-tenant
series, and no KV block is left held.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.request

import pytest

from tests.integration.cluster import free_ports
from tests.integration.stages import Stage, pipeline_stages

QUOTAS = ["--tenant-quota", "a=0.1", "--tenant-quota", "b", "--num-blocks", "64"]
LONG = list(range(100, 260))  # 160 tokens: 11 blocks with the first decode token's; a has 6


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tenants"))
    keys = os.path.join(d, "api-keys")
    with open(keys, "w") as f:
        f.write("# tenant key\na key-of-a\nb key-of-b\n")
    prefill, decode, keyed = pipeline_stages(
        d,
        [],
        gateway_args=["--disagg-threshold", "0", "--api-keys", keys],
        prefill_args=QUOTAS,
        decode_args=QUOTAS,
    )
    gp, hp = free_ports(2)
    open_gw = Stage(
        "gateway",
        gp,
        [
            "--http-port",
            str(hp),
            "--prefill",
            prefill.address,
            "--decode",
            decode.address,
            "--disagg-threshold",
            "0",
        ],
        os.path.join(d, "gateway-open.log"),
    )
    open_gw.http_port = hp
    stages = [prefill, decode, keyed, open_gw]
    try:
        for s in stages:
            s.start()
        yield prefill, decode, keyed, open_gw
    finally:
        for s in reversed(stages):
            s.stop()


def _post(gw: Stage, body: dict, headers: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", gw.http_port, timeout=120)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(body),
            {"Content-Type": "application/json", **headers},
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _metrics(stage: Stage) -> str:
    url = f"http://127.0.0.1:{stage.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_quota_refusal_is_a_429_naming_the_quota_and_others_are_served(stack):
    prefill, decode, keyed, open_gw = stack
    body = {"prompt": LONG, "max_tokens": 2, "temperature": 0}
    status, payload = _post(keyed, body, {"Authorization": "Bearer key-of-a"})
    assert status == 429, payload
    msg = payload["error"]["message"]
    assert "tenant 'a' is over its KV quota" in msg and "6 of the pool's 64 blocks" in msg, msg
    status, payload = _post(keyed, body, {"Authorization": "Bearer key-of-b"})
    assert status == 200 and payload["usage"]["completion_tokens"] == 2, payload
    # A short prompt of a's fits its quota.
    status, payload = _post(keyed, {**body, "prompt": LONG[:40]}, {"Authorization": "Bearer a"})
    assert status == 401, payload  # "a" is a tenant, not a key
    status, payload = _post(
        keyed, {**body, "prompt": LONG[:40]}, {"Authorization": "Bearer key-of-a"}
    )
    assert status == 200, payload
    # Keys on: X-Tenant cannot pick another tenant's quota.
    status, payload = _post(keyed, body, {"Authorization": "Bearer key-of-a", "X-Tenant": "b"})
    assert status == 429, payload

    # Keys off: the client names its tenant.
    status, payload = _post(open_gw, body, {"X-Tenant": "b"})
    assert status == 200, payload
    status, payload = _post(open_gw, body, {"X-Tenant": "a"})
    assert status == 429, payload
    status, payload = _post(open_gw, body, {"X-Tenant": "no such/tenant"})
    assert (
        status == 400
        and "X-Tenant: tenant name 'no such/tenant' is not valid" in (payload["error"]["message"])
    ), payload
    status, payload = _post(open_gw, body, {"X-Tenant": "x" * 65})
    assert status == 400 and "at most 64" in payload["error"]["message"], payload
    status, payload = _post(open_gw, body, {"X-Tenant": "c"})
    assert status == 400 and "tenant 'c' has no KV quota" in payload["error"]["message"], payload

    text = _metrics(prefill)
    assert 'tandem_tenant_quota_refusals_total{tenant="a"} 3.0' in text, text
    assert 'tandem_tenant_kv_quota_blocks{tenant="a"} 6.0' in text
    assert 'tandem_tenant_kv_quota_blocks{tenant="b"} 57.0' in text
    assert 'tandem_tenant_prefix_cache_hit_ratio{tenant="b"}' in text
    assert 'tandem_tenant_kv_blocks{tenant="b"}' in text
    assert 'tandem_tenant_kv_blocks{tenant="a"}' in _metrics(decode)
    gw_text = _metrics(keyed)
    assert 'tandem_tenant_requests_total{finish_reason="length",tenant="b"} 1.0' in gw_text
    assert 'tandem_tenant_requests_total{finish_reason="error",tenant="a"} 2.0' in gw_text

    # Nothing is left held on either worker (cached blocks nobody holds are free).
    deadline = time.monotonic() + 20
    for stage in (prefill, decode):
        while True:
            t = _metrics(stage)
            if "tandem_kv_cache_usage_ratio 0.0" in t or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert "tandem_kv_cache_usage_ratio 0.0" in t
