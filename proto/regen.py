"""Regenerate the committed Python stubs (``*_pb2.py``, ``*_pb2.pyi``, ``*_pb2_grpc.py``) for every
``.proto`` under ``proto/rollbook/v1``.

Run: ``python proto/regen.py`` (needs grpcio-tools). ``python proto/regen.py --out DIR`` writes them
elsewhere instead (the staleness test compares the two).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

PROTO_ROOT = pathlib.Path(__file__).resolve().parent


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc on every contract file; return the proto files compiled."""
    import importlib.resources

    from grpc_tools import protoc  # imported lazily: a dev/test dependency only

    protos = sorted((PROTO_ROOT / "rollbook" / "v1").glob("*.proto"))
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    out_dir.mkdir(parents=True, exist_ok=True)
    for proto in protos:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(proto.relative_to(PROTO_ROOT)),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")
    return protos


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=PROTO_ROOT, help="output root")
    args = parser.parse_args()
    protos = generate(args.out)
    print(f"generated stubs for {len(protos)} proto file(s) under {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
