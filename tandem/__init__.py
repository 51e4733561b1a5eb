"""Tandem: disaggregated LLM serving."""

from tandem.engine.sampling_params import SamplingParams
from tandem.llm import LLM, Completion, CompletionChunk

__all__ = ["LLM", "Completion", "CompletionChunk", "SamplingParams"]
__version__ = "0.1.0"
