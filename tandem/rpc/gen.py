"""Regenerate the committed gRPC stubs from protos/ (`make protos`)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
OUT = ROOT / "tandem" / "rpc"
FILES = ["tandem/v1/api.proto", "tandem/v1/stages.proto"]
# The grpcio the stubs ask for at import: the floor pyproject.toml admits, not the grpcio-tools
# release that wrote them (its stubs refuse an older grpcio, and each new release would make
# the committed stubs stale). What they call (`_registered_method`, registered method handlers)
# is older than this floor.
GRPC_FLOOR = "1.70.0"


def generate(out_dir: Path = OUT) -> list[Path]:
    """Run grpc_tools.protoc into `out_dir` and make the imports package-relative."""
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    tmp = out_dir / "_gen"
    tmp.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={tmp}",
        f"--pyi_out={tmp}",
        f"--grpc_python_out={tmp}",
        *FILES,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for src in sorted((tmp / "tandem" / "v1").glob("*")):
        text = src.read_text()
        # protoc emits `from tandem.v1 import api_pb2`; our stubs live flat in tandem.rpc.
        text = re.sub(r"from tandem\.v1 import (\w+)", r"from tandem.rpc import \1", text)
        text = re.sub(
            r"GRPC_GENERATED_VERSION = '[^']*'", f"GRPC_GENERATED_VERSION = '{GRPC_FLOOR}'", text
        )
        dst = out_dir / src.name
        dst.write_text(text)
        written.append(dst)
    for p in sorted(tmp.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    tmp.rmdir()
    return written


if __name__ == "__main__":
    for p in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT):
        print(os.path.relpath(p, ROOT))
