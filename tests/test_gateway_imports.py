"""The gateway is a front end: it imports no engine, kernel, triton or torch module.

What it shares with the engine lives in torch-free modules (`tandem/api/`, `tandem/step_time.py`,
`tandem/kv/names.py`, `tandem/model/info.py`). A serving gateway loads transformers for its
tokenizer and xgrammar to check grammars, and both load torch where torch is installed; so for a
serving process only the engine, the kernels, triton and Tandem's torch modules are checked.
"""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2

import services.gateway
from tandem.rpc import api_pb2, api_pb2_grpc
from tests.integration.cluster import free_ports
from tests.integration.stages import Stage, health

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT}
# Never imported by the gateway, not even to print its --help.
FORBIDDEN = ("torch", "triton", "tandem.kernels", "tandem.engine")
# Never imported by a serving gateway (transformers and xgrammar bring torch, see above).
FORBIDDEN_SERVING = (
    "triton",
    "tandem.kernels",
    "tandem.engine",
    "tandem.layers",
    "tandem.quant",
    "tandem.kv.cache",
    "tandem.model.llama",
    "tandem.model.loader",
    "tandem.model.gguf_loader",
)


def _matching(modules, prefixes: tuple[str, ...]) -> list[str]:
    """The modules in `modules` that are one of `prefixes` or inside one."""
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


def _imported(importtime_output: str) -> set[str]:
    """Module names in `python -X importtime` output (lines `import time: self | cum | name`)."""
    names = set()
    for line in importtime_output.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":  # the header line
                names.add(name)
    return names


def test_importtime_parsing():
    out = (
        "import time: self [us] | cumulative | imported package\n"
        "import time:       225 |        225 |       tandem.engine\n"
        "usage: tandem gateway [-h]\n"
        "import time:        10 |         12 |   torch._C\n"
    )
    assert _imported(out) == {"tandem.engine", "torch._C"}
    assert _matching(_imported(out), FORBIDDEN) == ["tandem.engine", "torch._C"]
    assert _matching({"torchvision", "tandem.engineer", "tandem"}, FORBIDDEN) == []


def test_gateway_modules_load_no_torch_and_no_engine():
    names = sorted(
        f"services.gateway.{m.name}"
        for m in pkgutil.iter_modules(services.gateway.__path__)
        if m.name != "__main__"
    )
    assert "services.gateway.pipeline" in names and "services.gateway.http_api" in names
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print('\\n'.join(sys.modules))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV
    )
    assert r.returncode == 0, r.stderr[-3000:]
    bad = _matching(r.stdout.split(), FORBIDDEN)
    assert not bad, f"the gateway's modules loaded {bad[:10]}"


def test_gateway_help_loads_no_torch_and_no_engine():
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "services.gateway", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--prefill" in r.stdout
    loaded = _imported(r.stderr)
    assert "services.gateway.server" in loaded
    bad = _matching(loaded, FORBIDDEN)
    assert not bad, f"`tandem gateway --help` loaded {bad[:10]}"


def _get(url: str) -> int:
    """The HTTP status of a GET (0 when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def test_a_serving_gateway_loads_no_engine(tmp_path):
    """A real gateway (default model, no workers up) answers liveness, health and requests;
    the modules it imported on the way, read from its -X importtime log, hold no engine."""
    gp, hp, pp, dp = free_ports(4)
    gateway = Stage(
        "gateway",
        gp,
        ["--http-port", str(hp), "--prefill", f"127.0.0.1:{pp}", "--decode", f"127.0.0.1:{dp}"],
        str(tmp_path / "gateway.log"),
        env={"PYTHONPROFILEIMPORTTIME": "1", "PYTHONPATH": ROOT},
    )
    base = f"http://127.0.0.1:{hp}"
    try:
        gateway.start(wait=False)
        deadline = time.monotonic() + 120
        while _get(f"{base}/livez") != 200:
            assert gateway.proc.poll() is None, gateway.log()[-3000:]
            assert time.monotonic() < deadline, "the gateway's /livez never answered"
            time.sleep(0.2)
        assert _get(f"{base}/health") == 503  # no worker is up
        assert health(gateway.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with grpc.insecure_channel(gateway.address) as channel:
            stub = api_pb2_grpc.GatewayStub(channel)
            # Refused at the gateway, naming the field: a sampling value and a grammar.
            unclosed = api_pb2.StructuredOutput(kind="regex", spec="[0-9")
            for sampling, field in [
                (api_pb2.SamplingParams(max_tokens=4, top_p=2.0), "top_p"),
                (api_pb2.SamplingParams(max_tokens=4, structured=unclosed), "regex"),
            ]:
                bad = api_pb2.GenerateRequest(prompt="Hello", sampling=sampling)
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Generate(bad, timeout=30))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert field in e.value.details()
            good = api_pb2.GenerateRequest(
                prompt="Hello", sampling=api_pb2.SamplingParams(max_tokens=4)
            )
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(good, timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    finally:
        gateway.stop()
    loaded = _imported(gateway.log())
    assert {"tandem.api.structured", "tandem.model.info"} <= loaded
    bad = _matching(loaded, FORBIDDEN_SERVING)
    assert not bad, f"the serving gateway loaded {bad[:10]}"
