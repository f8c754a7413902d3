"""`baton generate --router HOST:PORT`: the command line's sampling flags for the SDK.

Kept free of engine imports: the sampling parameters are read by attribute name, so any
object shaped like baton.sampling.SamplingParams works.
"""
from __future__ import annotations

from typing import Any

from baton.client.types import SAMPLING_OPTION_NAMES


def sampling_kwargs(params: Any) -> dict[str, Any]:
    """generate() sampling keywords from a SamplingParams-like object (missing attributes are
    left to the server's defaults)."""
    return {name: getattr(params, name) for name in sorted(SAMPLING_OPTION_NAMES) if hasattr(params, name)}
