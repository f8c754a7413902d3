"""Where Baton keeps what it builds once per machine (converted models, compiled kernels)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("BATON_CACHE_DIR", Path.home() / ".cache" / "baton"))
