"""`baton batch FILE`: a bad input file is refused (status 2, naming the line) before any cluster starts."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

import baton.launch.up
from baton import cli


@pytest.fixture
def no_cluster(monkeypatch):
    """Fail the test if the batch command starts a local cluster."""

    class NoCluster:
        def __init__(self, *args, **kwargs):
            raise AssertionError("baton batch started a local cluster for an input file it should have refused")

    monkeypatch.setattr(baton.launch.up, "LocalCluster", NoCluster)


@pytest.mark.parametrize("bad_line, message", [
    ('{"prompt": "x", "max_tokens": -3}', "max_tokens must be an integer >= 1"),
    ('{"prompt": ""}', "prompt must be non-empty text"),
    ('{"token_ids": [1, "a"]}', "token_ids[1] must be a token id"),
    ('{"token_ids": []}', "token_ids must be a non-empty list"),
    ('{"messages": [{"role": "user"}]}', "messages[0] needs"),
    ('{"messages": "hello"}', "messages must be a non-empty list"),
    ('{"prompt": "x", "temperature": "hot"}', "temperature must be a finite number"),
    ('{"prompt": "x", "top_p": 2}', "top_p"),
    ('{"prompt": "x", "seed": 1.5}', "seed"),
    ('{"prompt": "x", "stop": 7}', "stop"),
    ('{"prompt": "x", "promt": "y"}', "unknown key(s) ['promt']"),
    ('{"prompt": "x", "token_ids": [1]}', "exactly one of prompt, messages or token_ids"),
    ('[1, 2]', "each line must be a JSON object"),
    ('{"prompt": ', "not valid JSON"),
])
def test_a_bad_line_exits_2_naming_it_without_starting_a_cluster(tmp_path, capsys, no_cluster, bad_line, message):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + bad_line + "\n" + '{"prompt": "also fine"}\n')
    assert cli.main(["batch", str(path), "--model", "tiny-random"]) == cli.USAGE_ERROR
    err = capsys.readouterr().err
    assert f"{path}:3: " in err, err
    assert message in err, err


@pytest.mark.parametrize("flags, message", [
    (["--max-concurrency", "-1"], "--max-concurrency must be >= 0"),
    (["--timeout", "0"], "--timeout must be a positive"),
    (["--max-rows", "0"], "--max-rows must be >= 1"),
    (["--token", "t"], "add --router"),
])
def test_bad_flags_exit_2_without_starting_a_cluster(tmp_path, capsys, no_cluster, flags, message):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "fine"}\n')
    assert cli.main(["batch", str(path), "--model", "tiny-random", *flags]) == cli.USAGE_ERROR
    assert message in capsys.readouterr().err


def test_missing_or_empty_file_exits_2(tmp_path, capsys, no_cluster):
    assert cli.main(["batch", str(tmp_path / "absent.jsonl")]) == cli.USAGE_ERROR
    assert "cannot read" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert cli.main(["batch", str(empty)]) == cli.USAGE_ERROR
    assert "has no requests" in capsys.readouterr().err


def test_batch_command_refuses_a_bad_file_at_once(tmp_path):
    """The real command line: status 2 within seconds (no model loaded, no process started)."""
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": "x", "max_tokens": 0}\n')
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "baton.cli", "batch", str(path), "--model", "tiny-random"],
                          capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    print(f"\nbaton batch refused a bad file in {elapsed:.2f}s")
    assert done.returncode == 2, done.stderr
    assert f"{path}:2: max_tokens must be an integer >= 1" in done.stderr
    assert "starting a local cluster" not in done.stderr
    assert elapsed < 30
