"""Structured logs: one JSON object a line on stderr, quiet (WARNING) unless asked.

python-json-logger writes them, so a message holding quotes or a traceback is still valid JSON
and fields passed with `extra=` are kept as keys of their own. (An SDK-only install has no
python-json-logger: its `baton generate --router` logs plain lines instead.)"""
from __future__ import annotations

import logging
import sys

LEVELS = ("debug", "info", "warning", "error")


def level_name(text: str) -> str:
    """An argparse type: a level name in any case, or a usage error naming the choices."""
    if text.lower() not in LEVELS:
        import argparse

        raise argparse.ArgumentTypeError(f"{text!r} is not a log level; choose one of {', '.join(LEVELS)}")
    return text.lower()


def json_formatter() -> logging.Formatter:
    try:
        from pythonjsonlogger.json import JsonFormatter
    except ImportError:  # the SDK alone: the servers (the [server] extra) always have it
        return logging.Formatter("{asctime} {levelname} {name} {message}", style="{")
    return JsonFormatter("{asctime}{levelname}{name}{message}", style="{",
                         rename_fields={"asctime": "time", "levelname": "level", "name": "logger"})


def configure(level: str = "warning", stream=None) -> None:
    """Route every logger of this process through one JSON handler at `level`."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(json_formatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_baton", False)]:
        root.removeHandler(old)
    handler._baton = True  # so a second configure() replaces it instead of doubling every line
    root.addHandler(handler)
    root.setLevel(level.upper())
