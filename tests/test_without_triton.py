"""Where Triton has no wheels (macOS arm64), Tandem imports and serves on the torch references.

The child processes block `import triton` (as on a platform without its wheel) or leave it be,
and generate greedily with the embedded model on the CPU: the same tokens either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
if sys.argv[1] == "blocked":
    sys.modules["triton"] = None  # `import triton` raises ImportError, as without the wheel
import tandem
from tandem.kernels._triton import HAVE_TRITON
llm = tandem.LLM(device="cpu", num_blocks=32)
ids = llm.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
out = llm.generate([ids], tandem.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
print(json.dumps({"have_triton": HAVE_TRITON, "tokens": out.token_ids, "text": out.text}))
"""


def _generate(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, "-c", CHILD, mode],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"{mode}: exit {r.returncode}\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_serves_without_triton_as_with_it():
    without, with_ = _generate("blocked"), _generate("installed")
    assert without["have_triton"] is False and with_["have_triton"] is True
    assert len(without["tokens"]) == 12
    assert without["tokens"] == with_["tokens"], (without["text"], with_["text"])
    assert "Paris" in without["text"]


def test_a_kernel_launch_without_triton_says_why():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from tandem.kernels import argmax\n"
        "try:\n"
        "    argmax._argmax_kernel[(1,)]()\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "Triton is not installed" in r.stdout and "_argmax_kernel" in r.stdout
