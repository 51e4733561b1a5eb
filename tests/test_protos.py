"""The committed gRPC stubs are what `make protos` generates from protos/."""

from __future__ import annotations

from pathlib import Path

from tandem.rpc.gen import OUT, generate


def test_generated_stubs_are_fresh(tmp_path: Path):
    written = generate(tmp_path)
    assert written, "protoc produced nothing"
    for fresh in written:
        committed = OUT / fresh.name
        assert committed.exists(), f"{committed} is missing: run `make protos`"
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.name} is stale: run `make protos`"
        )


def test_stubs_ask_for_the_grpcio_pyproject_admits():
    """The stubs refuse to import under a grpcio older than the version they name: it is the
    floor of pyproject.toml's `grpcio>=`, whichever grpcio-tools wrote them."""
    import re

    from tandem.rpc.gen import GRPC_FLOOR, ROOT

    floor = re.search(r'"grpcio>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert floor is not None, "pyproject.toml names no grpcio floor"
    want = tuple(int(x) for x in floor.group(1).split("."))
    got = tuple(int(x) for x in GRPC_FLOOR.split("."))
    assert got[: len(want)] == want and not any(got[len(want) :]), (GRPC_FLOOR, floor.group(1))
    for stub in ("api_pb2_grpc.py", "stages_pb2_grpc.py"):
        assert f"GRPC_GENERATED_VERSION = '{GRPC_FLOOR}'" in (OUT / stub).read_text()
