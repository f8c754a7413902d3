"""Why a request could not be served, as the router's dispatch and its KV sources report it."""
from __future__ import annotations

import grpc

from baton.router.workers import Worker


class DispatchError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class DecodeLost(Exception):
    """The request must go on elsewhere: `worker`, its decode worker, failed or could not hand it off.
    prefilled: whether its prompt was prefilled for that worker (going on elsewhere prefills it again)."""

    def __init__(self, error: DispatchError, seed: int | None, worker: Worker, prefilled: bool = True):
        super().__init__(error.message)
        self.error = error
        self.seed = seed
        self.worker = worker
        self.prefilled = prefilled


def cause(err) -> DispatchError:
    """A gRPC error (or anything else) as the DispatchError the client is told."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.INTERNAL
    details = err.details() if hasattr(err, "details") else str(err)
    return DispatchError(code, details or code.name)
