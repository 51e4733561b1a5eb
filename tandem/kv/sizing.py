"""How large a worker's KV pool is when no size is given.

`--num-blocks` or `--kv-cache-memory-gb` size the pool exactly. Without either:

- on a CPU, `DEFAULT_KV_GB` (1 GiB: a CPU worker's pool is often shared memory, bounded by
  /dev/shm, and host memory is shared with everything else on the machine);
- on a GPU, the pool takes what `--gpu-memory-utilization` of the device's memory leaves once
  this process's weights are loaded and what it allocates beside them is set aside (one
  step's activations, the CUDA graphs' pool, the kernel autotuner's buffer, cuBLAS's
  workspaces), as vLLM's `gpu_memory_utilization` and SGLang's `mem_fraction_static` do. The
  fraction is this worker's share of the whole device, everything it allocates included:
  workers sharing one device need fractions that add up to at most one (`tandem up` splits it
  among the workers it starts on one device). The rest of the device (a tenth by default) is headroom. The pool
  never takes more than is free on the device now less the same set-aside, so another process
  already on the device is never pushed out of memory.

Sized this way, a Llama-3-8B bf16 worker alone on an 80 GB H100 gets about 50 GB of KV
(400k tokens); with a 1 GiB pool it would hold 8k tokens, a few sequences at load.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_KV_GB = 1.0  # a CPU worker's pool, and a draft model's own pool, when no size is given
GIB = 2**30
# Memory this process holds on the device outside torch's allocator (the CUDA context, library
# handles), which `torch.cuda.memory_reserved` does not count.
NON_TORCH_BYTES = GIB
# Triton's autotuner times a kernel's configurations on its first use with the L2 cache flushed
# through a 256 MiB buffer (triton.testing.do_bench); the batch-1 GEMV tunes while the CUDA
# graphs are captured, after the pool is allocated.
AUTOTUNE_BYTES = 256 * 2**20
# cuBLAS keeps a workspace for each stream it has run on, from torch's allocator, for the life of
# the process: 32 MiB each on Hopper by torch's default (less on older cards; a larger
# CUBLAS_WORKSPACE_CONFIG is not counted). The engine's GEMMs run on two streams: its own and
# the one its CUDA graphs are captured on.
CUBLAS_WORKSPACE_BYTES = 2 * 32 * 2**20


def auto_sized(config) -> bool:
    """Whether an engine config (`EngineConfig`) leaves its pool's size to this module."""
    return config.num_blocks is None and config.kv_cache_memory_gb is None


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory as one process sees it (bytes)."""

    total: int
    free: int  # free on the device now, every process counted
    own: int  # what this process's torch allocator holds now (weights, buffers)


@dataclass(frozen=True)
class ModelShape:
    """What a step's transient memory depends on."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


def activation_bytes(
    shape: ModelShape, max_num_batched_tokens: int, max_num_seqs: int, dtype_bytes: int
) -> int:
    """A bound on what the engine allocates on the device beside its weights and pool:
    one step's transient tensors (every per-token tensor of a layer alive at once for a full
    step's tokens: residual, norm, q/k/v, attention output, gate and up, the activation, down;
    and the sampled rows' float32 logits four times over: logits, the probabilities, the
    sampler's sorted copy and its indices), the same per-token tensors for the largest decode
    batch the CUDA graphs hold in their own pool, the autotuner's buffer and cuBLAS's
    workspaces."""
    s = shape
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    per_token = (4 * s.hidden_size + qkv + s.num_heads * s.head_dim + 3 * s.intermediate_size) * (
        dtype_bytes
    )
    rows = min(max_num_seqs, max_num_batched_tokens)
    step = max_num_batched_tokens * per_token + rows * s.vocab_size * 4 * 4
    return step + max_num_seqs * per_token + AUTOTUNE_BYTES + CUBLAS_WORKSPACE_BYTES


def gpu_kv_bytes(mem: DeviceMemory, utilization: float, activations: int) -> tuple[int, str]:
    """Bytes for the KV pool of a GPU worker, and how they were found (for the log).

    The budget: `utilization` of the device, less what this process holds (`mem.own` and
    NON_TORCH_BYTES) and `activations` (`activation_bytes`). Capped by what is free now less
    `activations` and NON_TORCH_BYTES again: what the free memory already lacks of this process
    is its CUDA context, not what its first steps still allocate outside torch (cuBLAS handles
    and workspaces, made on first use) nor the allocator's rounding. Raises ValueError, naming
    the settings, when that leaves no room."""
    budget = int(utilization * mem.total) - mem.own - NON_TORCH_BYTES - activations
    room = mem.free - activations - NON_TORCH_BYTES
    kv = min(budget, room)
    why = (
        f"{utilization:g} of {mem.total / GIB:.1f} GiB, less {mem.own / GIB:.1f} GiB of weights "
        f"and buffers, {NON_TORCH_BYTES / GIB:.1f} GiB outside torch and "
        f"{activations / GIB:.1f} GiB of activations, CUDA graphs, kernel tuning and cuBLAS"
    )
    if room < budget:
        why += f"; capped by the {mem.free / GIB:.1f} GiB free on the device (other processes)"
    if kv <= 0:
        raise ValueError(
            f"no device memory is left for the KV pool ({why}): raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens, free the device, or give "
            "--kv-cache-memory-gb / --num-blocks"
        )
    return kv, why
