"""Programmatic dependent launch (PDL) for the decode path's kernels (Hopper and later GPUs).

A batch-1 decode step is ~300 kernels, most of them a few microseconds long, so the time between
one kernel's last block and the next one's first useful load is a large part of the step. With
PDL a kernel is launched while its predecessor still runs: its blocks start, do what does not
depend on the predecessor (a GEMV loads its weights, which no kernel writes), then wait for the
predecessor to finish (`wait`) before they read its output. Each kernel lets its successor launch
(`launch_dependents`) once it has passed its own wait, so at most two kernels overlap.

The ordering rule that keeps this correct: every kernel launched with PDL calls `wait` before it
reads anything an earlier kernel wrote, and some of its programs always call it (a kernel none of
whose programs waited could finish before its predecessor, and its successor's wait would then
not cover the predecessor's writes). Memory read before the wait must be data no kernel of the
step writes; a program may leave before the wait only when it writes nothing.

The `pdl` kernel setting (`tandem.config.KernelConfig`, TANDEM_PDL=false) turns it off. It is used
only for compiled CUDA on compute capability >= 9.0, with a Triton that has the intrinsics;
elsewhere the flag is False and the calls compile to nothing.
"""

from __future__ import annotations

import torch

from tandem.config import kernel_config
from tandem.kernels._triton import tl, triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_PDL = True
except ImportError:  # pragma: no cover - a Triton without the intrinsics
    HAVE_PDL = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


_CAPABLE: dict[int, bool] = {}


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels on `t`'s device launch with PDL (`launch_pdl=` and the PDL constexpr)."""
    if not (HAVE_PDL and t.is_cuda):
        return False
    kc = kernel_config()
    if not kc.pdl or kc.interpreted:
        return False
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABLE:
        _CAPABLE[idx] = torch.cuda.get_device_capability(idx) >= (9, 0)
    return _CAPABLE[idx]


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the previous kernel has finished and its writes are visible (PDL only)."""
    if PDL:
        gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel launch (PDL only); call after `wait`."""
    if PDL:
        gdc_launch_dependents()


def prewait(t: torch.Tensor) -> bool:
    """Whether kernels on `t`'s device read more of their inputs before the wait than their
    weights: what the host copies in before a step (positions, slots, context lengths, block
    tables) and, in the decode attention, an L2 prefetch of K/V that the step does not write.
    Whenever they launch with PDL (measured faster on the H200 for bf16 and INT4 decode steps,
    Llama-3-8B shape)."""
    return use_pdl(t)


def launch_options(t: torch.Tensor) -> dict:
    """Keyword arguments for a kernel launch on `t`'s device: the kernel's `PDL` constexpr, and
    Triton's `launch_pdl` where PDL is used (the interpreter is not given the option)."""
    if use_pdl(t):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
