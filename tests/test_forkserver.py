"""The fork server LocalCluster starts Baton's processes from (launch/forkserver.py): each child is
what `python -m baton.cli ...` would be (its arguments, environment, directory and the caller's
streams at the time), its exit status reads as subprocess.Popen's, and it dies with the process
that asked for it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from baton.launch.forkserver import forkserver
from baton.launch.up import free_port, wait_serving

pytestmark = pytest.mark.slow


def router_argv(port: int, *more: str) -> list[str]:
    return ["router", "--host", "127.0.0.1", "--port", str(port), "--model", "tiny-random",
            "--prefill-workers", "127.0.0.1:1", "--decode-workers", "127.0.0.1:2", *more]


def test_exit_statuses_and_streams_are_a_fresh_processs(capfd):
    server = forkserver()
    assert server.start(["--help"], dict(os.environ)).wait(timeout=60) == 0
    assert server.start(["bogus"], dict(os.environ)).wait(timeout=60) == 2
    out, err = capfd.readouterr()
    assert "usage: baton" in out and "invalid choice: 'bogus'" in err


def test_a_child_has_its_arguments_environment_and_directory_and_dies_by_its_signal(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    port, http_port = free_port(), free_port()
    proc = forkserver().start(router_argv(port), dict(os.environ, BATON_ROUTER_HTTP_PORT=str(http_port)))
    try:
        wait_serving(f"127.0.0.1:{port}", proc, 120)
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
        assert f"OpenAI API on port {http_port}" in capfd.readouterr().err  # read from its environment
        assert Path(f"/proc/{proc.pid}/cwd").resolve() == tmp_path.resolve()
        assert os.getsid(proc.pid) == proc.pid  # a session of its own, as start_new_session gives
    finally:
        proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL and proc.poll() == -signal.SIGKILL


def test_children_die_with_the_process_that_started_them():
    port = free_port()
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, time
        from baton.launch.forkserver import forkserver
        from baton.launch.up import wait_serving
        proc = forkserver().start({router_argv(port, "--http-port", "0")!r}, dict(os.environ))
        wait_serving("127.0.0.1:{port}", proc, 120)
        print(proc.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and Path(f"/proc/{child}").exists() and \
            Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.2)
    alive = Path(f"/proc/{child}").exists() and Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "a forked router outlived the process that started it"


def test_the_default_tokenizer_read_before_forking_goes_to_the_first_caller_alone(monkeypatch, tmp_path):
    """The fork server reads the default tokenizer once (half a CPU-second each process would
    spend): a forked process's first default_tokenizer() gets that copy, later callers and a process
    whose default model lives elsewhere (another cache directory) read their own."""
    import shutil

    from baton.engine import model_files

    monkeypatch.setattr(model_files, "_preloaded_tokenizer", None)
    directory = model_files.default_model_dir()
    model_files.preload_default_tokenizer()
    preloaded = model_files._preloaded_tokenizer[1]
    assert model_files.default_tokenizer() is preloaded
    again = model_files.default_tokenizer()
    assert again is not preloaded and again.get_vocab() == preloaded.get_vocab()

    model_files.preload_default_tokenizer()
    elsewhere = tmp_path / "model"
    elsewhere.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (directory / name).is_file():
            shutil.copy(directory / name, elsewhere / name)
    monkeypatch.setattr(model_files, "default_model_dir", lambda: elsewhere)
    own = model_files.default_tokenizer()
    assert own is not model_files._preloaded_tokenizer[1] and own.name_or_path == str(elsewhere)

