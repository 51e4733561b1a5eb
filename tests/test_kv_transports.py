"""Choosing a KV transport, NIXL reads between two agents, and CUDA IPC's refusals on CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tandem.kv import cuda_ipc
from tandem.kv.cache import KVCache
from tandem.kv.transport import PoolLayout, accept_kinds, pick_kind
from tests.nixl_checks import nixl_missing_in_child

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_missing = nixl_missing_in_child()
needs_nixl = pytest.mark.skipif(
    # CI installs the extra (make install): there a missing NIXL fails the tests instead.
    _missing is not None and not os.environ.get("CI"),
    reason=f"NIXL is not usable here: {_missing}",
)


@pytest.mark.parametrize(
    "requested, device, nixl, expected",
    [
        ("auto", "cpu", True, ["shm", "nixl", "inline"]),
        ("auto", "cuda", True, ["cuda_ipc", "shm", "nixl", "inline"]),
        ("auto", "cpu", False, ["shm", "inline"]),
        ("nixl", "cpu", True, ["nixl"]),
        ("inline", "cuda", True, ["inline"]),
    ],
)
def test_accept_kinds(requested, device, nixl, expected):
    assert accept_kinds(requested, device, nixl) == expected


def test_accept_kinds_refuses_unknown_transport():
    with pytest.raises(ValueError, match="unknown KV transport 'rdma'"):
        accept_kinds("rdma", "cpu", True)


def _pick(accept, same_host, device="cpu", shm=True, nixl_missing=None):
    asked = []

    def missing():
        asked.append(True)
        return nixl_missing

    kind, reasons = pick_kind(
        accept,
        same_host=same_host,
        pool_device_type=device,
        has_shared_pool=shm,
        nixl_missing=missing,
    )
    return kind, reasons, bool(asked)


def test_auto_picks_shared_memory_on_one_host_without_loading_nixl():
    kind, _, asked = _pick(["shm", "nixl", "inline"], same_host=True)
    assert kind == "shm" and not asked
    kind, _, asked = _pick(
        ["cuda_ipc", "shm", "nixl", "inline"], same_host=True, device="cuda", shm=False
    )
    assert kind == "cuda_ipc" and not asked


def test_auto_picks_nixl_between_hosts_and_inline_without_it():
    assert _pick(["shm", "nixl", "inline"], same_host=False)[0] == "nixl"
    kind, _, _ = _pick(["shm", "nixl", "inline"], same_host=False, nixl_missing="not installed")
    assert kind == "inline"
    # A GPU prefill and a CPU decode on one host: no shared pool, NIXL moves VRAM to DRAM.
    kind, _, _ = _pick(["shm", "nixl", "inline"], same_host=True, device="cuda", shm=False)
    assert kind == "nixl"


def test_explicit_transport_that_cannot_work_says_why():
    kind, reasons, _ = _pick(["shm"], same_host=False)
    assert kind is None and reasons == ["shm: prefill and decode are on different hosts"]
    kind, reasons, _ = _pick(["cuda_ipc"], same_host=True, device="cpu")
    assert kind is None and "not on a GPU" in reasons[0]
    kind, reasons, _ = _pick(["nixl"], same_host=False, nixl_missing="NIXL is not installed")
    assert kind is None and "NIXL is not installed" in reasons[0]


@needs_nixl
@pytest.mark.parametrize(
    "check",
    [
        "plugin_dir_points_into_the_installed_package",
        "read_copies_exactly_the_listed_blocks:float32",
        "read_copies_exactly_the_listed_blocks:float8_e4m3fn",
        "refuses_a_peer_with_another_layout",
    ],
)
def test_nixl(check):
    """Each NIXL check runs in a child process (tests/nixl_checks.py says why)."""
    name, _, arg = check.partition(":")
    code = f"import tests.nixl_checks as c; c.{name}(*{[arg] if arg else []!r})"
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_cuda_ipc_refuses_cpu_pools_clearly():
    kv = KVCache.allocate(2, 4, 4, 2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="only a KV pool on a GPU"):
        cuda_ipc.export_pool(kv)
    if not torch.cuda.is_available():
        with pytest.raises(cuda_ipc.CudaIpcUnavailable, match="needs CUDA"):
            cuda_ipc.open_pool(b"{}", PoolLayout.of(kv), "GPU-0")
        assert cuda_ipc.device_uuid() == ""


def test_block_runs_merge_blocks_adjacent_in_both_pools_in_any_order():
    # Imported here without loading NIXL itself (tests/nixl_checks.py says why that matters).
    from tandem.kv.transport import block_runs

    src, dst, n = block_runs([12, 11, 10, 3, 4, 7, 8], [2, 1, 0, 5, 6, 9, 20])
    # 10-12 -> 0-2 (listed backwards), 3-4 -> 5-6, then 7 -> 9 and 8 -> 20 do not line up.
    assert src.tolist() == [3, 7, 8, 10] and dst.tolist() == [5, 9, 20, 0]
    assert n.tolist() == [2, 1, 1, 3]
    src, dst, n = block_runs(list(range(512))[::-1], list(range(100, 612))[::-1])
    assert (src.tolist(), dst.tolist(), n.tolist()) == ([0], [100], [512])
    assert block_runs([], [])[2].size == 0


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=["f32", "int8"])
@pytest.mark.parametrize(
    "src, dst",
    [
        (list(range(3, 19)), list(range(20, 36))),  # one run: slice copies, no temporary
        ([9, 8, 7, 2, 3], [4, 3, 2, 30, 31]),  # two runs listed backwards
        ([5, 17, 2, 30, 11, 23, 8, 1, 27, 14], [0, 9, 3, 21, 6, 12, 30, 18, 24, 15]),  # scattered
    ],
)
def test_gather_copy_equals_block_by_block(kv_dtype, src, dst):
    from tandem.kv.transport import gather_copy

    g = torch.Generator().manual_seed(len(src))
    a = KVCache.allocate(3, 40, 4, 2, 8, kv_dtype, "cpu")
    b = KVCache.allocate(3, 40, 4, 2, 8, kv_dtype, "cpu")
    for kv in (a, b):
        kv.data.view(torch.uint8).copy_(
            torch.randint(0, 120, kv.data.view(torch.uint8).shape, generator=g)
        )
        if kv.scales is not None:
            kv.scales.copy_(torch.rand(kv.scales.shape, generator=g))
    expect = b.data.clone()
    expect_scales = None if b.scales is None else b.scales.clone()
    for s, d in zip(src, dst, strict=True):
        expect[:, :, d] = a.data[:, :, s]
        if expect_scales is not None:
            expect_scales[:, :, d] = a.scales[:, :, s]
    gather_copy(b, dst, a, src)
    assert torch.equal(b.data.view(torch.uint8), expect.view(torch.uint8))
    if expect_scales is not None:
        assert torch.equal(b.scales, expect_scales)
