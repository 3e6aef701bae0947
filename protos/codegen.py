"""Regenerate the Python code of ``protos/*.proto`` (``python -m protos.codegen``).

The generated modules are committed; ``tests/test_protos.py`` fails when they are out of
date with the ``.proto`` files.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent


def generate(out_dir: Path | None = None) -> list[Path]:
    """Run protoc (from grpcio-tools) over every proto; return the written files."""
    from grpc_tools import protoc

    out = Path(out_dir) if out_dir else PROTO_DIR.parent
    (out / "protos").mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTO_DIR.glob("*.proto"))
    include = protoc._get_resource_file_name("grpc_tools", "_proto")  # well-known types
    args = [
        "protoc",
        f"-I{PROTO_DIR.parent}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p.relative_to(PROTO_DIR.parent)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return sorted((out / "protos").glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate():
        print(path)
    sys.exit(0)
