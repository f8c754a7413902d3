"""Structured logs: one JSON object a line on stderr, quiet (WARNING) unless asked.

python-json-logger writes them, so a message holding quotes or a traceback is still valid JSON
and fields passed with `extra=` are kept as keys of their own. (An SDK-only install has no
python-json-logger: its `baton generate --router` logs plain lines instead.)"""
from __future__ import annotations

import logging
import sys
import time

LEVELS = ("debug", "info", "warning", "error")
# What a process loads and the sizes it chooses at start: a few lines, shown at the default level
# (only --log-level error hides them), so `baton up` says what its workers are doing while they load.
STARTUP_LOGGER = "baton.startup"


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


def configure(level: str = "warning", stream=None, start_lines: bool = True) -> None:
    """Route every logger of this process through one JSON handler at `level` (the start-up lines
    at info at most, unless start_lines is off)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(json_formatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_baton", False)]:
        root.removeHandler(old)
    handler._baton = True  # so a second configure() replaces it instead of doubling every line
    root.addHandler(handler)
    root.setLevel(level.upper())
    start = "INFO" if start_lines and level.lower() == "warning" else level.upper()
    logging.getLogger(STARTUP_LOGGER).setLevel(start)


class Progress:
    """Work of `total` units (bytes, tokens) that may take a while: a line on `log` every `every_s`
    seconds while it lasts (none for work done sooner), saying how far it is."""

    def __init__(self, log: logging.Logger, what: str, total: int, unit: str = "bytes", every_s: float = 5.0):
        self.log, self.what, self.total, self.unit, self.every_s = log, what, max(total, 1), unit, every_s
        self.done = 0
        self.started = self.last = time.monotonic()

    def advance(self, amount: int) -> None:
        self.done += amount
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            rate = self.done / (now - self.started)
            left = (self.total - self.done) / rate if rate > 0 else float("inf")
            self.log.info("%s: %d of %d %s (%.0f%%), about %.0fs left", self.what, self.done, self.total, self.unit,
                          100 * self.done / self.total, left,
                          extra={"progress": self.done / self.total, "done": self.done, "total": self.total})
