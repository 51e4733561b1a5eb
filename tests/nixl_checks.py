"""NIXL checks run in child processes by tests/test_kv_transports.py.

The NIXL wheel bundles its own gRPC, protobuf and absl libraries; loading it into a process that
has grpc_tools' protoc loaded (tests/test_protos.py does) crashes that process, and so does the
reverse order. Tandem's workers never load protoc, but one pytest process runs every test, so
NIXL is only ever loaded in children.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from tandem.kv.cache import KVCache
from tandem.kv.layout import LayoutMismatch, PoolLayout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nixl_missing_in_child() -> str | None:
    """None when NIXL loads (in a child process), else why it does not."""
    code = (
        "from tandem.kv.transports.nixl import nixl_missing_reason as m; r = m(); "
        "print(r or '', end=''); raise SystemExit(1 if r else 0)"
    )
    try:
        r = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return "loading NIXL timed out"
    if r.returncode == 0:
        return None
    return r.stdout.strip() or r.stderr.strip()[-500:] or f"exit {r.returncode}"


def plugin_dir_points_into_the_installed_package() -> None:
    from tandem.kv.transports.nixl import load_nixl

    mod = load_nixl()
    plugins = os.environ["NIXL_PLUGIN_DIR"]
    assert os.path.exists(os.path.join(plugins, "libplugin_UCX.so")), plugins
    site = os.path.dirname(os.path.dirname(os.path.abspath(mod.__file__)))
    assert os.path.commonpath([plugins, site]) == site, (plugins, site)


def _pool(layers: int, blocks: int, dtype: torch.dtype, seed: int) -> KVCache:
    kv = KVCache.allocate(layers, blocks, 4, 2, 8, dtype, "cpu")
    g = torch.Generator().manual_seed(seed)
    if kv.scales is None:
        kv.data.copy_(torch.randn(kv.data.shape, generator=g))
    else:
        kv.data.view(torch.uint8).copy_(torch.randint(0, 120, kv.data.shape, generator=g))
        kv.scales.copy_(torch.rand(kv.scales.shape, generator=g))
    return kv


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def read_copies_exactly_the_listed_blocks(dtype_name: str) -> None:
    from tandem.kv.transports.nixl import NixlEndpoint

    dtype = getattr(torch, dtype_name)
    src = _pool(3, 10, dtype, 0)
    dst = KVCache.allocate(3, 7, 4, 2, 8, dtype, "cpu")
    a, b = NixlEndpoint("check-src", src), NixlEndpoint("check-dst", dst)
    try:
        peer = b.open_peer("src", a.info, PoolLayout.of(src))
        peer.read([9, 2, 3], [0, 5, 6], timeout_s=10)
        assert torch.equal(_raw(dst.data[:, :, [0, 5, 6]]), _raw(src.data[:, :, [9, 2, 3]]))
        assert not _raw(dst.data[:, :, [1, 2, 3, 4]]).any(), "other blocks were written"
        if dst.scales is not None:
            assert torch.equal(dst.scales[:, :, [0, 5, 6]], src.scales[:, :, [9, 2, 3]])
            assert not dst.scales[:, :, [1, 2, 3, 4]].any()
        # Runs adjacent in both pools, listed out of order (one descriptor per row and run),
        # beside pairs that only one side has adjacent.
        _raw(dst.data).zero_()
        src_ids, dst_ids = [6, 5, 4, 0, 1, 8, 9], [3, 2, 1, 5, 6, 0, 4]
        peer.read(src_ids, dst_ids, timeout_s=10)
        assert torch.equal(_raw(dst.data[:, :, dst_ids]), _raw(src.data[:, :, src_ids]))
        if dst.scales is not None:
            assert torch.equal(dst.scales[:, :, dst_ids], src.scales[:, :, src_ids])
        peer.read([], [], timeout_s=10)  # a prompt found whole in the prefix cache
        for bad, message in (([10], [0]), ([1, 2], [0]), ([1], [7])):
            try:
                peer.read(bad, message, timeout_s=10)
            except ValueError:
                pass
            else:
                raise AssertionError(f"reading {bad} into {message} was accepted")
        peer.close()
    finally:
        a.close()
        b.close()


def refuses_a_peer_with_another_layout() -> None:
    from tandem.kv.transports.nixl import NixlEndpoint

    src = _pool(3, 10, torch.float32, 0)
    dst = KVCache.allocate(2, 7, 4, 2, 8, torch.float32, "cpu")
    a, b = NixlEndpoint("check-layout-src", src), NixlEndpoint("check-layout-dst", dst)
    try:
        b.open_peer("src", a.info, PoolLayout.of(src))
    except LayoutMismatch as e:
        assert "num_layers: 2 here vs 3" in str(e), e
    else:
        raise AssertionError("a pool with another layout was opened")
    finally:
        a.close()
        b.close()
