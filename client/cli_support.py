"""`baton generate --router HOST:PORT`: the command line's prompts sent through the SDK.

Kept free of engine imports: the sampling parameters are read by attribute name, so any
object shaped like engine.sampling.SamplingParams works.
"""
from __future__ import annotations

from typing import Any

from baton.client.sync import BatonClient
from baton.client.types import SAMPLING_OPTION_NAMES, GenerationResult


def sampling_kwargs(params: Any) -> dict[str, Any]:
    """generate() sampling keywords from a SamplingParams-like object (missing attributes are
    left to the server's defaults)."""
    return {name: getattr(params, name) for name in sorted(SAMPLING_OPTION_NAMES) if hasattr(params, name)}


def generate_via_router(target: str, prompts: list[str], params: Any, raw: bool, insecure: bool = True,
                        *, token: str | None = None, timeout: float | None = None,
                        max_concurrency: int = 16) -> list[GenerationResult]:
    """Generate every prompt through the router at target, all at once; results in prompt order.

    raw=False sends each prompt as one user chat message (the chat template applied, as
    `baton generate --local` does); raw=True as plain text. insecure=False uses TLS with the
    system's root certificates. The first failure is raised as a client.errors.BatonError
    after every request finished."""
    kwargs = sampling_kwargs(params)
    with BatonClient(target, tls=not insecure, token=token, timeout=timeout) as client:
        return client.generate_many(list(prompts), max_concurrency=max_concurrency, raw=raw, **kwargs)
