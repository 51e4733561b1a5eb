"""Kernel settings: how the layers choose and launch their kernels, one set per process."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from tandem.config_options import parse_value

PREFILL_ATTENTION_BACKENDS = ("auto", "sdpa", "triton")
# The fields that are also EngineConfig fields, of the same name and type: EngineConfig declares
# their flags and TANDEM_* variables, and `from_env` reads those variables.
ENGINE_FIELDS = ("prefill_attention", "deterministic", "pdl")


def triton_interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter on the CPU (Triton's own TRITON_INTERPRET
    variable, which Triton reads when it is imported) rather than compiling them for the GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class KernelConfig:
    """How the layers choose and launch their kernels. One per process (`kernel_config()`): an
    engine installs its own (`EngineConfig.kernel_config`, `set_kernel_config`) when it starts;
    without one the TANDEM_* variables of the EngineConfig fields of the same names, then the
    defaults, apply."""

    # Multi-token attention on CUDA (prefill, prompt chunks, speculative verification): "triton"
    # is one launch over the paged cache for the whole batch; "sdpa" gathers each sequence's KV
    # and calls torch's SDPA (flash) per sequence; "auto" picks by the H200 measurement in
    # bench/results/h200_prefill_attention.json (see `tandem.model.llama.varlen_attention_kind`).
    prefill_attention: str = "auto"
    # The one-row INT4 GEMVs sum their K split through partials and a last program instead of
    # float atomics into a zeroed float32 row: steps are bit-reproducible, and slower.
    deterministic: bool = False
    pdl: bool = True  # programmatic dependent launch where the GPU and Triton have it
    # Triton interprets kernels on the CPU (TRITON_INTERPRET): no inline PTX, no PDL.
    interpreted: bool = field(default_factory=triton_interpreted)

    def validate(self) -> None:
        if self.prefill_attention not in PREFILL_ATTENTION_BACKENDS:
            raise ValueError(
                f"prefill_attention must be one of {', '.join(PREFILL_ATTENTION_BACKENDS)}; "
                f"got {self.prefill_attention!r}"
            )

    @classmethod
    def from_env(cls) -> KernelConfig:
        """The defaults, overridden by TANDEM_PREFILL_ATTENTION, TANDEM_DETERMINISTIC, TANDEM_PDL."""
        opts = {}
        for f in fields(cls):
            env = os.environ.get(f"TANDEM_{f.name.upper()}")
            if f.name in ENGINE_FIELDS and env is not None:
                opts[f.name] = parse_value(env, f.type, f.name)
        cfg = cls(**opts)
        cfg.validate()
        return cfg


_KERNELS: KernelConfig | None = None


def kernel_config() -> KernelConfig:
    """This process's kernel settings (built from the environment on first use)."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = KernelConfig.from_env()
    return _KERNELS


def set_kernel_config(cfg: KernelConfig | None) -> KernelConfig | None:
    """Install this process's kernel settings (None: rebuilt from the environment on next use);
    returns the previous ones. Set before a model is built: a captured CUDA graph keeps the
    kernels it captured."""
    global _KERNELS
    if cfg is not None:
        cfg.validate()
    old, _KERNELS = _KERNELS, cfg
    return old
