"""Errors the SDK raises: one class per gRPC status that a caller handles differently.

Every failed call raises a `BatonError` (or a subclass) carrying the status name as `.code`
(e.g. "INVALID_ARGUMENT") and the server's own words as `.message`. Bad arguments found
before any RPC is sent raise a plain `ValueError` (or `TypeError` for an unknown keyword);
`InvalidRequest` is also a `ValueError`, so `except ValueError` catches bad input whichever
side noticed it.
"""
from __future__ import annotations

from typing import Any, Iterable

import grpc

RETRY_AFTER_METADATA_KEY = "retry-after-s"


class BatonError(Exception):
    """A call to the Baton router failed.

    code: the gRPC status name ("UNAVAILABLE", ...); message: the server's details;
    request_id: the request's id when known; trailing_metadata: the server's trailers as a dict.
    batch_results: set by `generate_many(..., return_exceptions=False)` on the error it raises:
    every slot's result or error, in input order, so the other requests are not lost.
    """

    def __init__(self, code: str, message: str, *, request_id: str | None = None,
                 trailing_metadata: dict[str, str] | None = None):
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.trailing_metadata = dict(trailing_metadata or {})
        self.batch_results: list[Any] | None = None

    def __str__(self) -> str:
        where = f" (request {self.request_id})" if self.request_id else ""
        return f"{self.code}: {self.message}{where}"

    def __reduce__(self):
        # Exceptions pickle via args; ours also carry attributes, restored through __dict__.
        return (self.__class__, (self.code, self.message), self.__dict__)


class InvalidRequest(BatonError, ValueError):
    """INVALID_ARGUMENT: the server refused the request as given; change it before retrying."""


class Overloaded(BatonError):
    """RESOURCE_EXHAUSTED: the cluster is full. Retry after `retry_after_s` seconds when the
    server said how long (trailing metadata `retry-after-s`), else after a backoff of your own."""

    def __init__(self, code: str, message: str, *, request_id: str | None = None,
                 trailing_metadata: dict[str, str] | None = None):
        super().__init__(code, message, request_id=request_id, trailing_metadata=trailing_metadata)
        self.retry_after_s = _parse_retry_after(self.trailing_metadata.get(RETRY_AFTER_METADATA_KEY))


class DeadlineExceeded(BatonError):
    """DEADLINE_EXCEEDED: the call's deadline (the `timeout` seconds) passed before it finished."""


class Unavailable(BatonError):
    """UNAVAILABLE: no connection to the router (wrong address, not up yet, TLS mismatch)."""


class Cancelled(BatonError):
    """CANCELLED: the call was cancelled, by this client or by the server."""


class Unauthenticated(BatonError):
    """UNAUTHENTICATED: no valid credentials; pass `token=` or a client certificate."""


class PermissionDenied(BatonError):
    """PERMISSION_DENIED: the credentials are valid but not allowed to do this."""


_CLASS_BY_CODE: dict[str, type[BatonError]] = {
    "INVALID_ARGUMENT": InvalidRequest,
    "RESOURCE_EXHAUSTED": Overloaded,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
    "UNAVAILABLE": Unavailable,
    "CANCELLED": Cancelled,
    "UNAUTHENTICATED": Unauthenticated,
    "PERMISSION_DENIED": PermissionDenied,
}


def error_for_code(code: str, message: str, *, request_id: str | None = None,
                   trailing_metadata: dict[str, str] | None = None) -> BatonError:
    """The BatonError subclass for a status name; unknown names get the base class."""
    cls = _CLASS_BY_CODE.get(code, BatonError)
    return cls(code, message, request_id=request_id, trailing_metadata=trailing_metadata)


def error_from_rpc(error: grpc.RpcError, request_id: str | None = None) -> BatonError:
    """Map a failed gRPC call (sync or grpc.aio) to the BatonError subclass for its status."""
    status = _call_or_none(error, "code")
    code = status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
    message = _call_or_none(error, "details") or str(error)
    trailers = _metadata_to_dict(_call_or_none(error, "trailing_metadata"))
    return error_for_code(code, message, request_id=request_id, trailing_metadata=trailers)


def _call_or_none(error: grpc.RpcError, method: str) -> Any:
    # A bare grpc.RpcError need not be a Call; most are (_InactiveRpcError, AioRpcError).
    getter = getattr(error, method, None)
    try:
        return getter() if callable(getter) else None
    except Exception:  # a half-finished call can refuse to report; the status still maps
        return None


def _metadata_to_dict(metadata: Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    result: dict[str, str] = {}
    for key, value in metadata or ():
        result[key] = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return result


def _parse_retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None
