"""Generate the Python gRPC stubs (with ``.pyi`` type stubs) from ``proto/``.

The output is the package ``specdraft.v1`` at the repository root (``specdraft/v1/*_pb2*.py``):
built by ``make setup`` before the editable install, ignored by git, never edited by hand.

    python client/build_stubs.py            # (re)generate
    python client/build_stubs.py --check    # exit 1 if the stubs are missing or stale

This file is run as a script before the project is installed, so it imports nothing of ours.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE = ("specdraft", "v1")
HEADER = '"""Generated from proto/ by client/build_stubs.py; do not edit."""\n'


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT.joinpath(*PACKAGE)).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Write the stubs under ``out_root/specdraft/v1``; return the files written."""
    from grpc_tools import protoc

    files = proto_files()
    if not files:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    include = str(resources.files("grpc_tools") / "_proto")
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(f.relative_to(PROTO_ROOT)) for f in files),
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    package_dir = out_root.joinpath(*PACKAGE)  # specdraft/ itself is hand-written (stubs, common)
    (package_dir / "__init__.py").write_text(HEADER)
    return sorted(p for p in package_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def stale(out_root: Path = ROOT) -> list[str]:
    """Generated files that differ from (or are missing next to) a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        problems = []
        for path in fresh:
            rel = path.relative_to(tmp)
            installed = out_root / rel
            if not installed.is_file():
                problems.append(f"missing: {rel}")
            elif not filecmp.cmp(path, installed, shallow=False):
                problems.append(f"stale: {rel}")
        return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify instead of writing")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale()
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("run: python client/build_stubs.py", file=sys.stderr)
        return 1 if problems else 0
    for path in generate(ROOT):
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
