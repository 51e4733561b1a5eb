"""GPU tests: each starts with the device memory the tests before it used given back."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _device_memory_given_back():
    """An engine a test built lives in reference cycles (its engine thread's callbacks, its
    runner's graphs) until the cyclic collector runs, which a long session does rarely: a
    Llama-3-8B one kept 18 GB allocated through every later test. Collected after each test,
    and the allocator's cache returned to the device, so that a test sizing its pool from free
    memory, or capturing graphs, does not inherit its predecessors' memory."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
