"""GPU tests: each starts with the device memory the tests before it used given back."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _device_memory_given_back():
    """A test's engine can outlive the test until the cyclic collector runs, which a long
    session does rarely: a traceback that a library keeps from an import made on the test's
    behalf holds, in a reference cycle, every frame above it, the test's with its locals (seen
    on a CPU with transformers' lazy imports). On an H100 a Llama-3-8B engine kept 18 GB
    allocated through every later test. Collected after each test, and the allocator's cache
    returned to the device, so that a test sizing its pool from free memory, or capturing
    graphs, does not inherit its predecessors' memory."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
