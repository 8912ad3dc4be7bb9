"""Generate the Python gRPC stubs in weightserver/v1 from protos/.

    python scripts/gen_protos.py            # write the stubs into the repo
    python scripts/gen_protos.py --out DIR  # write them under DIR (the drift test uses this)

The proto path mirrors the package path (protos/weightserver/v1/weights.proto ->
weightserver/v1/weights_pb2.py), so the stubs import as `weightserver.v1.weights_pb2` with
no rewriting. Needs the grpcio-tools pinned in constraints.txt.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ["weightserver/v1/weights.proto"]


def generate(out: Path) -> None:
    """Run grpc_tools.protoc for every proto, writing *_pb2.py, *_pb2.pyi, *_pb2_grpc.py."""
    from grpc_tools import protoc

    well_known = str(resources.files("grpc_tools") / "_proto")
    out.mkdir(parents=True, exist_ok=True)
    for proto in PROTOS:
        args = [
            "protoc",
            f"-I{ROOT / 'protos'}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(ROOT / "protos" / proto),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: repo root)")
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
