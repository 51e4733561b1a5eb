"""What a benchmark's result records about how it was made: the revision, the host, the command.

Every script under bench/ writes these into its JSON, so that a number can be traced to the
code and machine that produced it.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import shlex
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def revision() -> tuple[str, bool | None]:
    """(revision, uncommitted changes) of this tree. TANDEM_GIT_REV names the revision of a copy
    whose history stays elsewhere (a device machine's copy, a `git archive`); else git's HEAD,
    or "unknown". The changes: None when git cannot tell."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    rev = os.environ.get("TANDEM_GIT_REV")
    if not rev:
        try:
            rev = git("rev-parse", "HEAD")
        except (OSError, subprocess.CalledProcessError):
            rev = "unknown"
    try:
        dirty: bool | None = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        dirty = None
    return rev, dirty


def git_revision() -> str:
    """The revision, with " (uncommitted changes)" when the tree has them."""
    rev, dirty = revision()
    return rev + (" (uncommitted changes)" if dirty else "")


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), or what the platform says."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        return cpu


def gpu_models() -> list[str]:
    """The GPUs `nvidia-smi` lists ("name, memory"), without starting CUDA in this process;
    [] where there is none."""
    query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def run_metadata() -> dict[str, Any]:
    """The command, revision, date, library versions and host of a CPU-side benchmark run."""
    import torch

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "git_revision": git_revision(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": tf_version,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "torch_num_threads": torch.get_num_threads(),
        "loadavg_at_start": list(os.getloadavg()),
    }
