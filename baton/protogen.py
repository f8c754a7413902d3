"""Generate the Python wire code for every `proto/baton/v1/*.proto`, or check it is current.

    python -m baton.protogen            # regenerate baton/v1/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py
    python -m baton.protogen --check    # exit 1 and list stale files if the checked-in code differs

protoc runs with `-I proto` and writes into the repository root, so `proto/baton/v1/x.proto`
becomes the importable module `baton.v1.x_pb2` (and `_pb2_grpc` imports it as
`from baton.v1 import x_pb2`). The generated files are checked in.
"""
from __future__ import annotations

import argparse
import filecmp
import importlib.resources
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_PACKAGE_DIR = Path("baton") / "v1"  # relative to both the proto root and the output root
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_sources(repo_root: Path) -> list[Path]:
    """Every .proto under proto/baton/v1, sorted so generation order is stable."""
    return sorted((repo_root / "proto" / PROTO_PACKAGE_DIR).glob("*.proto"))


def generate(repo_root: Path, out_root: Path) -> list[Path]:
    """Run protoc on every source; return the generated files relative to out_root.

    In a process of its own: its compiler links its own copy of protobuf and abseil, which must not
    meet another one a library already loaded here (NIXL's UCX plugins load theirs globally, and
    the compiler then crashed the process)."""
    import grpc_tools  # imported here so `--help` works without grpc_tools

    sources = proto_sources(repo_root)
    if not sources:
        raise SystemExit(f"no .proto files under {repo_root / 'proto' / PROTO_PACKAGE_DIR}")
    proto_root = repo_root / "proto"
    well_known_types = importlib.resources.files(grpc_tools) / "_proto"
    args = [
        sys.executable, "-m", "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known_types}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(source) for source in sources),
    ]
    if subprocess.run(args).returncode != 0:
        raise SystemExit("protoc failed; see its messages above")
    return sorted(path.relative_to(out_root) for path in _generated_files(out_root / PROTO_PACKAGE_DIR))


def find_stale(repo_root: Path) -> list[str]:
    """Generated files that are missing, differ from a fresh generation, or have no .proto left."""
    with tempfile.TemporaryDirectory(prefix="baton-protogen-") as tmp:
        fresh_root = Path(tmp)
        fresh = generate(repo_root, fresh_root)
        problems = []
        for relative in fresh:
            checked_in = repo_root / relative
            if not checked_in.exists():
                problems.append(f"{relative} (missing)")
            elif not filecmp.cmp(checked_in, fresh_root / relative, shallow=False):
                problems.append(f"{relative} (differs)")
        fresh_set = set(fresh)
        for path in _generated_files(repo_root / PROTO_PACKAGE_DIR):
            relative = path.relative_to(repo_root)
            if relative not in fresh_set:
                problems.append(f"{relative} (orphaned: its .proto is gone)")
        return problems


def _generated_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m baton.protogen", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if checked-in code is stale")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    repo_root = args.root.resolve()
    if args.check:
        stale = find_stale(repo_root)
        if stale:
            print("generated protobuf code is stale; run `python -m baton.protogen`:", file=sys.stderr)
            for line in stale:
                print(f"  {line}", file=sys.stderr)
            return 1
        print(f"generated protobuf code is current ({len(proto_sources(repo_root))} .proto files)")
        return 0
    with tempfile.TemporaryDirectory(prefix="baton-protogen-") as tmp:
        fresh_root = Path(tmp)
        fresh = generate(repo_root, fresh_root)  # first, so a protoc error leaves the tree untouched
        for path in _generated_files(repo_root / PROTO_PACKAGE_DIR):
            path.unlink()  # so a removed .proto leaves no orphaned module behind
        for relative in fresh:
            shutil.copyfile(fresh_root / relative, repo_root / relative)
            print(f"wrote {relative}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
