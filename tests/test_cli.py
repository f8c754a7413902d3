"""The command line as an operator meets it, in-process: help for every flag, the environment in
`--help`, clear argument errors, valid JSON logs, and `--help` without torch."""
from __future__ import annotations

import argparse
import io
import json
import logging
import subprocess
import sys

import pytest

from baton.cli import build_parser, main
from baton.logs import configure


def every_action(parser: argparse.ArgumentParser, path=("baton",)):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from every_action(sub, (*path, name))
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_flag_of_every_command_says_what_it_does():
    missing = [(" ".join(path), action.option_strings or action.dest)
               for path, action in every_action(build_parser()) if not action.help]
    assert missing == []


def test_help_lists_the_environment_variables(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for name in ("BATON_CLUSTER_TOKEN", "BATON_AUTH_TOKEN", "BATON_CACHE_DIR", "BATON_<SECTION>_<KEY>",
                 "BATON_CPU_KERNELS"):
        assert name in out


def test_an_unknown_log_level_is_a_usage_error_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--log-level", "verbose", "up"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "'verbose' is not a log level" in err and "debug, info, warning, error" in err
    assert build_parser().parse_args(["--log-level", "INFO", "up"]).log_level == "info"
    # after the command too, and the default stays when it is given nowhere
    assert build_parser().parse_args(["router", "--log-level", "debug"]).log_level == "debug"
    assert build_parser().parse_args(["up"]).log_level == "warning"
    with pytest.raises(SystemExit):
        main(["decode", "--log-level", "verbose"])


def test_log_lines_are_json_with_quotes_tracebacks_and_extra_fields():
    stream = io.StringIO()
    root = logging.getLogger()
    level = root.level
    try:
        configure("info", stream)
        configure("info", stream)  # configuring twice does not double the lines
        log = logging.getLogger("baton.test")
        log.info('the worker said "no"', extra={"request_id": "r-1", "worker": "127.0.0.1:1"})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("it failed")
        log.debug("not at info")
    finally:
        for handler in [h for h in root.handlers if getattr(h, "_baton", False)]:
            root.removeHandler(handler)
        root.setLevel(level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 2
    assert lines[0]["message"] == 'the worker said "no"' and lines[0]["level"] == "INFO"
    assert (lines[0]["request_id"], lines[0]["worker"], lines[0]["logger"]) == ("r-1", "127.0.0.1:1", "baton.test")
    assert "RuntimeError: boom" in lines[1]["exc_info"] and lines[1]["level"] == "ERROR"


def test_help_starts_without_importing_torch():
    code = ("import sys\nfrom baton.cli import main\n"
            "for argv in (['--help'], ['router', '--help'], ['decode', '--help'], ['generate', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy')]\n"
            "assert not heavy, heavy[:5]\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_models_are_found_by_directory_or_in_the_local_hugging_face_cache(tmp_path, monkeypatch):
    """`--model org/name` works offline when the hub cache holds it; nothing is downloaded."""
    from baton.engine.model import ModelLoadError, model_dir

    snapshot = tmp_path / "hub" / "models--acme--tiny-chat" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--acme--tiny-chat" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-chat" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_dir("acme/tiny-chat") == snapshot
    assert model_dir(str(snapshot)) == snapshot
    with pytest.raises(ModelLoadError, match="nothing is downloaded"):
        model_dir("acme/not-here")
    with pytest.raises(ModelLoadError, match="no config.json"):
        model_dir(str(tmp_path))


def test_quantization_flags_reach_every_worker_a_command_starts():
    """`baton up` and `baton batch` start their workers with the model loaded as their flags say;
    a serving command takes them as config keys."""
    from baton.cli.args import load_role_settings
    from baton.launch.up import model_env

    up = build_parser().parse_args(["up", "--quantization", "gguf", "--quantized-inputs", "8"])
    assert model_env(up) == {"BATON_MODEL_QUANTIZATION": "gguf", "BATON_MODEL_QUANTIZED_INPUTS": "8"}
    assert model_env(build_parser().parse_args(["batch", "in.jsonl", "--quantization", "int8"])) == {
        "BATON_MODEL_QUANTIZATION": "int8"}
    assert model_env(build_parser().parse_args(["up"])) == {}
    decode = build_parser().parse_args(["decode", "--quantization", "int8", "--quantized-inputs", "8"])
    settings = load_role_settings(decode)
    assert (settings.model.quantization, settings.model.quantized_inputs) == ("int8", 8)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--quantization", "fp4", "hi"])


def test_tensor_parallel_flags_set_each_pools_degree():
    """`baton up --tp 2` splits both pools; --prefill-tp and --decode-tp set one each; a worker
    takes --tensor-parallel-size (or --tp) as the config key model.tensor_parallel_size."""
    from baton.cli.args import load_role_settings
    from baton.launch.up import tp_args

    both = build_parser().parse_args(["up", "--tp", "2"])
    assert tp_args(both, "prefill") == tp_args(both, "decode") == ("--tensor-parallel-size", "2")
    mixed = build_parser().parse_args(["up", "--prefill-tp", "4", "--decode-tp", "2"])
    assert (tp_args(mixed, "prefill"), tp_args(mixed, "decode")) == (("--tensor-parallel-size", "4"),
                                                                     ("--tensor-parallel-size", "2"))
    assert tp_args(build_parser().parse_args(["up"]), "decode") == ()
    for flag in ("--tp", "--tensor-parallel-size"):
        settings = load_role_settings(build_parser().parse_args(["prefill", flag, "2"]))
        assert settings.model.tensor_parallel_size == 2
    assert load_role_settings(build_parser().parse_args(["decode"])).model.tensor_parallel_size == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--tp", "3"])
    with pytest.raises(SystemExit):  # the router holds no model
        build_parser().parse_args(["router", "--tp", "2"])
