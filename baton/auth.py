"""Token authentication: clients at the router's public API, and the cluster among itself.

Two credentials, never interchangeable:
- the client token: every call to the router carries `authorization: Bearer <token>` (the SDK's
  `BatonClient(token=...)`);
- the cluster token: every call to a prefill or decode worker (Prefill, Decode, KV Push, pins,
  cancels, handoffs, load polls) carries `x-baton-cluster-token: <token>`, which only the router
  and the workers hold. A client's token, or a client certificate the cluster's CA signed, opens
  no worker port.
The stock health and reflection services stay open to probes and tooling. A missing or wrong token
is UNAUTHENTICATED, decided before the request message is even parsed; both sides are hashed to a
fixed length and compared with `hmac.compare_digest`, so the time taken does not depend on them.
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
CLUSTER_TOKEN_KEY = "x-baton-cluster-token"  # the metadata key of the cluster credential
CLUSTER_TOKEN_ENV = "BATON_CLUSTER_TOKEN"  # cluster.token, by the BATON_<SECTION>_<KEY> convention
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


def read_token_file(path: str, setting: str) -> str:
    """The token in the file `setting` names, checked; ValueError naming the setting otherwise."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ValueError(f"{setting}: cannot read {path!r} ({why})") from None
    return check_token(text.strip(), f"{setting} {path!r}")


def load_token(token_file: str, env: Mapping[str, str]) -> str | None:
    """The router's token: from router.auth_token_file, else the BATON_AUTH_TOKEN environment
    variable; None when neither is set (no auth). Both set is refused as ambiguous."""
    from_env = env.get(TOKEN_ENV)
    if token_file and from_env is not None:
        raise ValueError(f"both router.auth_token_file and {TOKEN_ENV} are set; keep one")
    if token_file:
        return read_token_file(token_file, "router.auth_token_file")
    if from_env is not None:
        return check_token(from_env.strip(), f"environment variable {TOKEN_ENV}")
    return None


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class TokenCheck:
    """Compares a presented token with the expected one in constant time: both sides are hashed to
    a fixed length first, so the time taken depends on neither."""

    def __init__(self, expected: str):
        self._expected = _digest(expected.encode())

    def matches(self, given: bytes | str) -> bool:
        return hmac.compare_digest(_digest(given.encode() if isinstance(given, str) else given), self._expected)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call outside EXEMPT_SERVICES whose `key` metadata is
    not `expected`. `missing` and `wrong` say what the caller should do."""

    def __init__(self, key: str, expected: str, missing: str, wrong: str):
        self._key, self._expected, self._missing, self._wrong = key, TokenCheck(expected), missing, wrong

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
        values = [value for key, value in metadata if key == self._key]
        if not values:
            return self._missing
        if len(values) > 1:
            return f"send exactly one '{self._key}' metadata entry"
        value = values[0]
        given = value.encode() if isinstance(value, str) else bytes(value)
        if self._expected.matches(given):
            return None
        return self._wrong(given)


def BearerTokenInterceptor(token: str) -> TokenInterceptor:  # noqa: N802 - reads as the class it builds
    """The router's check of its clients' `authorization: Bearer <token>`."""
    def wrong(given: bytes) -> str:
        if not given.startswith(b"Bearer "):
            return "the authorization metadata must be 'Bearer <token>'"
        return "the bearer token is not valid for this router; check the token you were given"

    return TokenInterceptor("authorization", f"Bearer {check_token(token, 'the bearer token')}",
                            missing=("this router requires a bearer token: send the metadata 'authorization: "
                                     "Bearer <token>' (BatonClient(token=...))"),
                            wrong=wrong)


def ClusterTokenInterceptor(token: str) -> TokenInterceptor:  # noqa: N802
    """A worker's check that the caller is the router or another worker of this cluster."""
    return TokenInterceptor(
        CLUSTER_TOKEN_KEY, check_token(token, "the cluster token"),
        missing=("this is a Baton worker port: only the router and the cluster's workers may call it "
                 "(the cluster credential is missing; clients go through the router)"),
        wrong=lambda given: "the cluster credential is not valid for this worker; check cluster.token")


def load_cluster_token(token: str, token_file: str) -> str | None:
    """The cluster's token: cluster.token (usually the BATON_CLUSTER_TOKEN environment variable, from
    a Secret) or the file cluster.token_file names; None when neither is set (worker ports open)."""
    if token and token_file:
        raise ValueError("both cluster.token (BATON_CLUSTER_TOKEN) and cluster.token_file are set; keep one")
    if token_file:
        return read_token_file(token_file, "cluster.token_file")
    if token:
        return check_token(token.strip(), "cluster.token (BATON_CLUSTER_TOKEN)")
    return None


class _ClusterCredential(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                         grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the cluster token to every call a channel makes."""

    def __init__(self, token: str):
        self._entry = (CLUSTER_TOKEN_KEY, token)

    def _details(self, details):
        return details._replace(metadata=[*(details.metadata or ()), self._entry])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


def with_cluster_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """The channel, presenting the cluster token on every call (unchanged when there is none)."""
    return grpc.intercept_channel(channel, _ClusterCredential(token)) if token else channel


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
