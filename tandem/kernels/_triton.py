"""Triton for the kernel modules, or a stand-in where Triton has no wheels (macOS, Windows).

Every kernel module imports `triton` and `tl` from here. With Triton installed they are Triton
itself. Without it the modules still import, so the torch reference beside each kernel (what
runs on a CPU anyway) serves: `@triton.jit` gives an object that raises when launched, and
`tl.*` names (the kernels' `tl.constexpr` annotations) are placeholders. Nothing on a CPU
launches a kernel unless `TRITON_INTERPRET=1` asks for Triton's interpreter, which needs Triton.
"""

from __future__ import annotations

import math
from typing import Any

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # no Triton wheel for this platform
    HAVE_TRITON = False

    class _Unavailable:
        """A `@triton.jit` function without Triton: importable, never launchable."""

        def __init__(self, fn: Any) -> None:
            self.fn = fn
            self.__name__ = getattr(fn, "__name__", "kernel")

        def _fail(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"Triton kernel {self.__name__} launched, but Triton is not installed on this "
                "platform: the torch reference should have run (a device other than CUDA)"
            )

        __call__ = _fail

        def __getitem__(self, grid: Any) -> Any:
            return self._fail

    class _Language:
        """`triton.language` without Triton: every name is a placeholder."""

        def __getattr__(self, name: str) -> Any:
            return self

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self

    class _Triton:
        language = _Language()

        @staticmethod
        def jit(fn: Any = None, **kwargs: Any) -> Any:
            return _Unavailable(fn) if fn is not None else _Unavailable

        @staticmethod
        def autotune(*args: Any, **kwargs: Any) -> Any:
            return lambda fn: fn

        heuristics = autotune

        @staticmethod
        def Config(*args: Any, **kwargs: Any) -> None:  # noqa: N802 - Triton's name
            return None

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 if n <= 1 else 2 ** math.ceil(math.log2(n))

    triton = _Triton()  # type: ignore[assignment]
    tl = triton.language  # type: ignore[assignment]

__all__ = ["HAVE_TRITON", "tl", "triton"]
