"""Bearer-token authentication for the router's public API.

Every call must carry `authorization: Bearer <token>` metadata (the client SDK sends it with
`BatonClient(token=...)`), except the stock health and reflection services, which probes and
tooling reach without credentials. A missing or wrong token is UNAUTHENTICATED, decided before
the request message is even parsed. The comparison takes the same time whatever the token sent:
both sides are hashed to a fixed length and compared with `hmac.compare_digest`.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Mapping
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

TOKEN_ENV = "BATON_AUTH_TOKEN"  # the token itself (e.g. from a Kubernetes Secret), when no file is set
EXEMPT_SERVICES = frozenset({
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
})
# What an HTTP/2 header value may hold, without spaces: the token goes after "Bearer ".
_TOKEN_CHARS = re.compile(r"[\x21-\x7e]+")


def check_token(token: str, source: str) -> str:
    if not token:
        raise ValueError(f"{source} is empty; put the bearer token in it, or unset it to turn auth off")
    if not _TOKEN_CHARS.fullmatch(token):
        raise ValueError(f"{source}: the bearer token may hold only printable ASCII without spaces; "
                         "generate one with e.g. `openssl rand -hex 32`")
    return token


def load_token(token_file: str, env: Mapping[str, str]) -> str | None:
    """The router's token: from router.auth_token_file, else the BATON_AUTH_TOKEN environment
    variable; None when neither is set (no auth). Both set is refused as ambiguous."""
    from_env = env.get(TOKEN_ENV)
    if token_file and from_env is not None:
        raise ValueError(f"both router.auth_token_file and {TOKEN_ENV} are set; keep one")
    if token_file:
        try:
            text = Path(token_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ValueError(f"router.auth_token_file: cannot read {token_file!r} ({why})") from None
        return check_token(text.strip(), f"router.auth_token_file {token_file!r}")
    if from_env is not None:
        return check_token(from_env.strip(), f"environment variable {TOKEN_ENV}")
    return None


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call outside EXEMPT_SERVICES without the right token."""

    def __init__(self, token: str):
        self._expected = _digest(f"Bearer {check_token(token, 'the bearer token')}".encode())

    def intercept_service(self, continuation, handler_call_details):
        service = handler_call_details.method.lstrip("/").rpartition("/")[0]
        if service in EXEMPT_SERVICES:
            return continuation(handler_call_details)
        problem = self._problem(handler_call_details.invocation_metadata or ())
        if problem is None:
            return continuation(handler_call_details)
        log.info("refused %s: %s", handler_call_details.method, problem)
        return _refusal(continuation(handler_call_details), problem)

    def _problem(self, metadata) -> str | None:
        """None when the call carries the token, else what is wrong with its credentials."""
        values = [value for key, value in metadata if key == "authorization"]
        if not values:
            return ("this router requires a bearer token: send the metadata 'authorization: Bearer <token>' "
                    "(BatonClient(token=...))")
        if len(values) > 1:
            return "send exactly one 'authorization' metadata entry"
        value = values[0]
        given = value.encode() if isinstance(value, str) else bytes(value)
        # Hashed first, so the comparison's time does not depend on the length of either side.
        if hmac.compare_digest(_digest(given), self._expected):
            return None
        if not given.startswith(b"Bearer "):
            return "the authorization metadata must be 'Bearer <token>'"
        return "the bearer token is not valid for this router; check the token you were given"


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as the real one that aborts at once. It reads the request as raw
    bytes: an unauthenticated caller's message is never parsed."""

    def abort(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None or (not handler.request_streaming and not handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(abort)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    return grpc.unary_stream_rpc_method_handler(abort)
