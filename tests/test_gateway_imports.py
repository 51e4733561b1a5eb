"""The gateway is a front end: importing it loads neither torch nor triton (nor any kernel)."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys

import services.gateway

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gateway_modules_load_no_torch_and_no_kernels():
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
        "bad = sorted(m for m in sys.modules\n"
        "             if m.split('.')[0] in ('torch', 'triton') or m.startswith('tandem.kernels'))\n"
        "print(','.join(bad))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "", f"the gateway loaded {r.stdout.strip()}"


def test_gateway_help_loads_no_torch():
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "services.gateway", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if "|" in line}
    bad = sorted(m for m in loaded if m.split(".")[0] in ("torch", "triton"))
    assert not bad, f"`tandem gateway --help` loaded {bad[:10]}"
