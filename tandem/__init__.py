"""Tandem: disaggregated LLM serving."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# OpenMP (torch's CPU threads) sleeps between parallel regions instead of spinning. libgomp spins
# ~300k iterations after each region; when another process holds a core, the spinning thread
# takes the core the working one needs. Measured on a 2-core Xeon VM with other
# work running, SmolLM2-135M batch-1 decode, 2 threads: 2-4 tok/s spinning, 20-47 sleeping
# (1 thread: 13-33 either way). Read by OpenMP when torch loads, so it is set here, before
# anything loads torch; a value set in the environment already wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = ["LLM", "Completion", "CompletionChunk", "SamplingParams"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from tandem.api.sampling_params import SamplingParams
    from tandem.llm import LLM, Completion, CompletionChunk

# The in-process API loads torch; the command line (`tandem up`, `tandem chat`) starts without it.
_LAZY = {
    "SamplingParams": "tandem.api.sampling_params",
    "LLM": "tandem.llm",
    "Completion": "tandem.llm",
    "CompletionChunk": "tandem.llm",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
