"""How a client reaches the router: TLS material, bearer token, message limits, deadlines.

Checked once when a client is made; the sync and asyncio clients build their channels from it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from baton.transport import RECONNECT_OPTIONS

LOAD_BALANCING = (None, "pick_first", "round_robin")  # gRPC's policies (None: its default, pick_first)
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# A call left without a deadline waits forever on a router that froze; this one ends it.
DEFAULT_TIMEOUT_S = 600.0
# While calls are open the client pings the router this often, and gives up on the connection
# when a ping is not answered within KEEPALIVE_TIMEOUT_S: a frozen or unreachable router is
# noticed in seconds, not at the deadline. The router permits pings every 0.25 s.
DEFAULT_KEEPALIVE_S = 10.0
KEEPALIVE_TIMEOUT_S = 5.0
# A call the router never started on (no connection, a router draining or still loading, a
# worker that just left) is made again, by gRPC's own retry policy, up to this many more times
# (gRPC allows 4) with a growing, jittered pause, within the call's deadline. A stream that has
# sent a token is never started again: it fails as it is.
DEFAULT_MAX_RETRIES = 2
MAX_RETRIES = 4
RETRY_BACKOFF_S = (0.2, 2.0)
RETRIED_METHODS = ("Generate", "GenerateBatch", "GetModelInfo")
# wait_ready: long enough for a large model's workers to load; it says what it still waits for.
DEFAULT_READY_TIMEOUT_S = 300.0
READY_POLL_S = 0.25

PemSource = bytes | str | os.PathLike | None


@dataclass(frozen=True)
class ConnectionConfig:
    target: str  # "host:port"
    timeout: float | None  # default per-call deadline in seconds; None = no deadline
    tls: bool
    root_certificates: bytes | None  # PEM; None = the system's roots
    client_cert: bytes | None  # PEM certificate chain for mutual TLS
    client_key: bytes | None  # PEM private key for mutual TLS
    token: str | None  # sent as `authorization: Bearer <token>` on every call
    max_message_bytes: int
    tls_server_name: str | None  # check the server's certificate for this name, not the target's host
    keepalive_s: float | None  # ping the router this often while calls are open; None = never
    # "round_robin": spread calls over every address the target resolves to (a headless Service,
    # dns:///baton-router-headless.<namespace>.svc:50051) instead of pinning the first one
    load_balancing: str | None = None
    max_retries: int = DEFAULT_MAX_RETRIES  # calls refused UNAVAILABLE before any answer are made again

    @classmethod
    def from_args(cls, target: str, *, timeout: float | None = DEFAULT_TIMEOUT_S, tls: bool = False,
                  root_certificates: PemSource = None, client_cert: PemSource = None,
                  client_key: PemSource = None, token: str | None = None,
                  max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                  tls_server_name: str | None = None,
                  keepalive_s: float | None = DEFAULT_KEEPALIVE_S,
                  load_balancing: str | None = None, max_retries: int = DEFAULT_MAX_RETRIES) -> "ConnectionConfig":
        if not isinstance(target, str) or not target.strip():
            raise ValueError(f"target must be 'host:port' of a Baton router (got {target!r})")
        check_timeout(timeout)
        if (client_cert is None) != (client_key is None):
            raise ValueError("mutual TLS needs both client_cert= and client_key= (got only one)")
        if not tls and any(v is not None for v in (root_certificates, client_cert, client_key, tls_server_name)):
            raise ValueError("root_certificates, client_cert, client_key and tls_server_name need tls=True")
        if token is not None and (not isinstance(token, str) or not token or "\n" in token):
            raise ValueError("token must be a non-empty single-line string (sent as 'authorization: Bearer <token>')")
        if keepalive_s is not None and (isinstance(keepalive_s, bool) or not isinstance(keepalive_s, (int, float))
                                        or not keepalive_s >= 0.25):
            raise ValueError(f"keepalive_s must be seconds >= 0.25 between pings, or None for none (got {keepalive_s!r})")
        if load_balancing not in LOAD_BALANCING:
            raise ValueError(f"load_balancing must be one of {LOAD_BALANCING} (got {load_balancing!r})")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or not 0 <= max_retries <= MAX_RETRIES:
            raise ValueError(f"max_retries must be an integer from 0 to {MAX_RETRIES} (got {max_retries!r})")
        if not isinstance(max_message_bytes, int) or max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be an integer >= 1024 (got {max_message_bytes!r})")
        return cls(target=target.strip(), timeout=timeout, tls=tls,
                   root_certificates=_read_pem(root_certificates, "root_certificates"),
                   client_cert=_read_pem(client_cert, "client_cert"),
                   client_key=_read_pem(client_key, "client_key"),
                   token=token, max_message_bytes=max_message_bytes, tls_server_name=tls_server_name,
                   keepalive_s=keepalive_s, load_balancing=load_balancing, max_retries=max_retries)

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials, or None for a plaintext channel."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates,
                                            private_key=self.client_key, certificate_chain=self.client_cert)

    def options(self) -> list[tuple[str, object]]:
        options: list[tuple[str, object]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            # A router that restarts (a rolling update, a crash) comes back at its address: calls
            # made then reach it within about a second, where gRPC's own backoff would refuse
            # them at once for up to two minutes, and a new client would inherit that refusal.
            *RECONNECT_OPTIONS,
        ]
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        if self.load_balancing:
            options.append(("grpc.lb_policy_name", self.load_balancing))
        if self.keepalive_s is not None:
            options += [("grpc.keepalive_time_ms", int(self.keepalive_s * 1000)),
                        ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
                        # a ping in flight for flow control must not hold the keepalive ping back
                        ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
                        ("grpc.http2.max_pings_without_data", 0)]
        if self.max_retries:
            options.append(("grpc.service_config", json.dumps({"methodConfig": [{
                # not GetClusterStatus: it reports the cluster as it is (wait_ready polls it)
                "name": [{"service": "baton.v1.Router", "method": m} for m in RETRIED_METHODS],
                "retryPolicy": {"maxAttempts": 1 + self.max_retries, "initialBackoff": f"{RETRY_BACKOFF_S[0]}s",
                                "maxBackoff": f"{RETRY_BACKOFF_S[1]}s", "backoffMultiplier": 2,
                                "retryableStatusCodes": ["UNAVAILABLE"]}}],
                # while most calls fail (a router down for long) retries stop, instead of tripling the load
                "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}})))
        else:
            options.append(("grpc.enable_retries", 0))
        return options

    def metadata(self) -> tuple[tuple[str, str], ...]:
        # Plain metadata rather than call credentials: those refuse plaintext channels, and a
        # router behind a TLS-terminating proxy is reached in plaintext.
        auth = (("authorization", f"Bearer {self.token}"),) if self.token else ()
        return auth + _trace_context()

    def deadline(self, timeout: float | None) -> float | None:
        """The deadline in seconds for one call: its own timeout, else the client's default."""
        check_timeout(timeout)
        return self.timeout if timeout is None else timeout


def _trace_context() -> tuple[tuple[str, str], ...]:
    """The caller's current OpenTelemetry span as W3C trace context, when the application uses
    OpenTelemetry: the router's trace of the request then joins the caller's."""
    try:
        from opentelemetry import propagate
    except ImportError:
        return ()
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def check_timeout(timeout: float | None) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise ValueError(f"timeout must be a number of seconds > 0, or None for no deadline (got {timeout!r})")


def _read_pem(source: PemSource, name: str) -> bytes | None:
    """PEM bytes as given, or read from a file path."""
    if source is None or isinstance(source, bytes):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            return path.read_bytes()
        except OSError as error:
            raise ValueError(f"{name}: cannot read PEM file {str(path)!r}: {error.strerror}") from error
    raise ValueError(f"{name} must be PEM bytes or a file path (got {type(source).__name__})")
