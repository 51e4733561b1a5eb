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
