"""The built wheel as a user installs it: one `baton` namespace, and an SDK without torch.

Builds the wheel, installs it (no extras) into a fresh virtual environment and talks to a real
local cluster from there.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from baton.launch.up import LocalCluster

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools leaves a build/ folder in the tree it builds.
    source = tmp_path_factory.mktemp("source") / "baton"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", ".helm-venv", "build", "*.egg-info",
                                                                 "__pycache__", "bench-results", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(source)], check=True, timeout=300)
    (found,) = out.glob("baton_serve-*.whl")
    return found


def test_the_wheel_puts_everything_under_one_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"baton", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    for package in ("client", "engine", "router", "kvtransfer", "prefill_worker", "decode_worker", "planner",
                    "launch", "bench", "cli"):
        assert f"baton/{package}/__init__.py" in names
    assert {"baton/engine/cpu/kernels.c", "baton/engine/cpu/kernels_typed.h"} <= set(names)  # compiled at first use
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
    plain = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert sorted(plain) == ["Requires-Dist: grpcio>=1.85.1", "Requires-Dist: protobuf>=7.35.1"]
    scripts = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/entry_points.txt"))).decode()
    assert "baton = baton.cli:main" in scripts and "baton-health = baton.cli.health_check:main" in scripts


def test_the_sdk_installs_without_torch_and_talks_to_a_cluster(wheel, tmp_path):
    venv = tmp_path / "sdk"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
                   check=True, timeout=600)
    with LocalCluster(prefill=1, decode=1, model="tiny-random") as cluster:
        script = textwrap.dedent(f"""
            import importlib.util, sys
            from baton.client import BatonClient
            assert importlib.util.find_spec("torch") is None, "torch is installed"
            with BatonClient({cluster.router_address!r}) as client:
                result = client.generate(token_ids=[5, 6, 7, 8], max_tokens=4, ignore_eos=True)
            heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "transformers", "redis"))
            assert not heavy, heavy
            print(len(result.token_ids))
        """)
        done = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        # The console scripts start on the SDK alone: `baton generate --router` needs nothing more.
        cli = subprocess.run([str(venv / "bin" / "baton"), "generate", "--router", cluster.router_address, "--raw",
                              "--json", "--max-tokens", "3", "hello"], capture_output=True, text=True, timeout=120,
                             cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "4"
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["prompt"] == "hello"
    health = subprocess.run([str(venv / "bin" / "baton-health"), "--port", "1"], capture_output=True, text=True,
                            timeout=60)
    assert health.returncode == 2 and "baton-serve[server]" in health.stderr  # a clear word, not a traceback
