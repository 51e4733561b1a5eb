"""Tandem: disaggregated LLM serving."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.config import set_openmp_defaults

set_openmp_defaults()  # before anything loads torch (OpenMP reads it once, at load)

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
