"""Regenerates the Python code of pardec's proto contract, or checks that it is fresh.

    python protos/generate.py          # rewrite client/pardec/v1/*_pb2*.py{,i}
    python protos/generate.py --check  # exit 1 if regenerating would change anything

The .proto files and the generated modules live in the light client's distribution
(client/, pardec-client), the one copy the server depends on. The generated modules are
committed so that an install needs no code generation; the check (run by the tests) keeps
them in step with the .proto files. grpcio-tools is pinned in pyproject.toml because its
output differs between versions.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

# The include root: the .proto files import each other as "pardec/v1/<name>.proto".
PROTO_ROOT = Path(__file__).resolve().parent.parent / "client"
PACKAGE_DIR = PROTO_ROOT / "pardec" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PACKAGE_DIR.glob("*.proto"))
    include = Path(protoc.__file__).resolve().parent / "_proto"
    code = protoc.main(
        [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            *protos,
        ]
    )
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")


def generated_files(root: Path) -> dict[str, Path]:
    package = root / "pardec" / "v1"
    return {
        p.name: p
        for p in package.iterdir()
        if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args()
    if not args.check:
        for stale in generated_files(PROTO_ROOT).values():
            stale.unlink()
        generate(PROTO_ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generated_files(_generate_into(Path(tmp)))
        committed = generated_files(PROTO_ROOT)
        stale = sorted(
            name
            for name in fresh.keys() | committed.keys()
            if name not in fresh
            or name not in committed
            or not filecmp.cmp(fresh[name], committed[name], shallow=False)
        )
    if stale:
        print("stale generated code (run `python protos/generate.py`):", *stale, sep="\n  ")
        return 1
    print("generated code is fresh")
    return 0


def _generate_into(root: Path) -> Path:
    (root / "pardec" / "v1").mkdir(parents=True)
    generate(root)
    return root


if __name__ == "__main__":
    sys.exit(main())
