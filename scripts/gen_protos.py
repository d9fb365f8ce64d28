"""Regenerate the Python code of protos/specdec/v1/*.proto into specdec/v1/.

    python scripts/gen_protos.py            # write specdec/v1/*_pb2*.py(i)
    python scripts/gen_protos.py --out DIR  # write under DIR instead (tests compare with the committed files)

Needs grpcio-tools (pinned in the ``test`` extra so the output is reproducible).
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out: Path) -> list[Path]:
    """Run protoc (python, pyi, grpc) on every proto; returns the generated files."""
    from grpc_tools import protoc

    protos = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_ROOT.rglob("*.proto"))
    include = str(resources.files("grpc_tools") / "_proto")
    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in out.rglob("*_pb2*.py*"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
