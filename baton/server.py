"""What every Baton gRPC process shares: server options, health, reflection, TLS, shutdown."""
from __future__ import annotations

import logging
import threading
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from baton import lifeline
from baton.auth import ClusterTokenInterceptor, load_cluster_token, with_cluster_token
from baton.config import ClusterSettings, TLSSettings
from baton.transport import CHANNEL_OPTIONS, SERVER_OPTIONS, merge_options

log = logging.getLogger(__name__)

def _read_pem(path: str, setting: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"tls.{setting}: cannot read {path!r} ({exc.strerror}); "
                         "point it at a readable PEM file") from None


def channel(target: str, tls: TLSSettings | None = None, extra_options=(), cluster_token: str | None = None
            ) -> grpc.Channel:
    """A channel to another Baton component: TLS when this process has a certificate (the peer is
    checked against tls.ca_file, or the system roots), presenting that certificate for mutual TLS.
    With tls.server_name the peer's certificate must name that host instead of the target's.
    extra_options are added to the channel's options (e.g. kvtransfer's push keepalive); with
    cluster_token, every call presents the cluster credential (calls to workers)."""
    if tls is None or not tls.enabled:
        options = merge_options(CHANNEL_OPTIONS, extra_options)
        return with_cluster_token(grpc.insecure_channel(target, options=options), cluster_token)
    tls.validate()
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read_pem(tls.ca_file, "ca_file") if tls.ca_file else None,
        private_key=_read_pem(tls.key_file, "key_file"),
        certificate_chain=_read_pem(tls.cert_file, "cert_file"),
    )
    options = merge_options(tls_channel_options(tls), extra_options)
    return with_cluster_token(grpc.secure_channel(target, creds, options=options), cluster_token)


def cluster_token(cluster: ClusterSettings | None, role: str, host: str = "127.0.0.1") -> str | None:
    """This process's cluster credential, from its settings. A worker without one listens only on a
    loopback address, unless cluster.insecure says to listen open anyway (ValueError otherwise)."""
    token = load_cluster_token(cluster.token, cluster.token_file) if cluster is not None else None
    if token is None and role != "router":
        if not is_loopback(host) and not (cluster is not None and cluster.insecure):
            raise ValueError(
                f"this {role} worker would listen on {host} with no cluster token, answering anyone who reaches "
                f"it: set BATON_CLUSTER_TOKEN (or cluster.token_file) to the token its router holds, listen on "
                f"--host 127.0.0.1 for a worker on this machine only, or pass --insecure to serve it open anyway")
        log.warning("no cluster token (cluster.token / BATON_CLUSTER_TOKEN): this %s worker's port answers "
                    "anyone who can reach %s", role, host)
    return token


def is_loopback(host: str) -> bool:
    """A listen address only this machine reaches: 127.0.0.0/8, ::1, localhost."""
    import ipaddress

    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def tls_channel_options(tls: TLSSettings) -> list[tuple[str, object]]:
    """CHANNEL_OPTIONS, plus the certificate name override when tls.server_name is set."""
    if not tls.server_name:
        return list(CHANNEL_OPTIONS)
    return [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", tls.server_name)]


def server_credentials(tls: TLSSettings, require_client_cert: bool = True) -> grpc.ServerCredentials:
    """This process's certificate; with tls.ca_file and require_client_cert, clients must present
    a certificate that CA signed (mutual TLS)."""
    tls.validate()
    return grpc.ssl_server_credentials(
        [(_read_pem(tls.key_file, "key_file"), _read_pem(tls.cert_file, "cert_file"))],
        root_certificates=_read_pem(tls.ca_file, "ca_file") if tls.ca_file else None,
        require_client_auth=bool(tls.ca_file) and require_client_cert,
    )


# gRPC Python reports "no deadline" as ~9.2e18 seconds left, not the None it documents; handed
# on as a timeout to another call, that overflows into an instant DEADLINE_EXCEEDED.
NO_DEADLINE_SECONDS = 1e9


class _Context:
    """The servicer context, with time_remaining() None when the caller set no deadline."""

    __slots__ = ("_context",)

    def __init__(self, context):
        self._context = context

    def __getattr__(self, name):
        return getattr(self._context, name)

    def time_remaining(self) -> float | None:
        remaining = self._context.time_remaining()
        return None if remaining is None or remaining > NO_DEADLINE_SECONDS else remaining


class _Unparsable:
    """What the request deserializer hands on for bytes that are not the method's request message."""

    def __init__(self, type_name: str, error: Exception):
        self.message = f"the request is not a valid {type_name} message ({error}); send it with the generated stubs"


class _RequestStreamBroken(grpc.RpcError):
    """Raised into a servicer reading a request stream that holds an unparsable message: to the
    servicer it looks like any other broken request stream, so it frees what it held."""


class CallConventions(grpc.ServerInterceptor):
    """What every Baton servicer may rely on, whatever the caller sent:

    - bytes that do not parse as the method's request message are the caller's fault:
      INVALID_ARGUMENT naming the message type, not gRPC's own INTERNAL "Exception deserializing
      request!"; a request stream stops at the bad message (the servicer sees a broken stream);
    - `context.time_remaining()` is None when the caller set no deadline."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        parse = handler.request_deserializer
        if parse is None:
            lenient = None
        else:
            message_type = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
            type_name = message_type.full_name if message_type is not None else "request"

            def lenient(data: bytes):
                try:
                    return parse(data)
                except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's
                    return _Unparsable(type_name, exc)

        if handler.unary_unary or handler.unary_stream:
            behavior = _single_request(handler.unary_unary or handler.unary_stream)
        elif handler.stream_unary:
            behavior = _streaming_request(handler.stream_unary)
        else:
            behavior = _streaming_request_and_response(handler.stream_stream)
        make = _HANDLER_MAKERS[handler.request_streaming, handler.response_streaming]
        return make(behavior, request_deserializer=lenient, response_serializer=handler.response_serializer)


_HANDLER_MAKERS = {  # (request streaming, response streaming) -> handler factory
    (False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler,
}


def _single_request(behavior):
    def call(request, context):
        if isinstance(request, _Unparsable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return behavior(request, _Context(context))

    return call


class _CheckedStream:
    """A request stream that stops at the first unparsable message and remembers it."""

    def __init__(self, requests):
        self._requests = requests
        self.bad: _Unparsable | None = None

    def __iter__(self):
        for request in self._requests:
            if isinstance(request, _Unparsable):
                self.bad = request
                raise _RequestStreamBroken(request.message)
            yield request

    def blame(self, context) -> None:
        """Whatever the servicer answered, an unparsable message was the caller's fault."""
        if self.bad is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.bad.message)


def _streaming_request(behavior):
    def call(request_iterator, context):
        stream = _CheckedStream(request_iterator)
        try:
            result = behavior(iter(stream), _Context(context))
        except Exception:
            stream.blame(context)
            raise
        stream.blame(context)
        return result

    return call


def _streaming_request_and_response(behavior):
    def call(request_iterator, context):
        stream = _CheckedStream(request_iterator)
        try:
            yield from behavior(iter(stream), _Context(context))
        except Exception:
            stream.blame(context)
            raise
        stream.blame(context)

    return call


def run_when_ended(context, callback) -> bool:
    """Run `callback` when the call of `context` ends, or now if it already has: gRPC refuses
    add_callback then, and never resumes a streaming handler, so work for a call nobody waits for
    would otherwise be left behind. False when the call had ended."""
    if context.add_callback(callback):
        return True
    callback()
    return False


class NotReady:
    """Stands in for a servicer until the model has loaded: every call answers UNAVAILABLE."""

    def __init__(self):
        self.target = None

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)

        # Looked up per call: gRPC binds handlers once, at registration, before the model loads.
        def call(request, context):
            target = self.target
            if target is None:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
            return getattr(target, name)(request, context)

        return call


SHORT_CALL_THREADS = 32  # KV pushes, handoffs, load polls, health, pins: each brief


class GrpcServer:
    """A gRPC server with the stock health service (NOT_SERVING until `set_serving`) and reflection.

    `interceptors` run before every call (the router's bearer-token check), then CallConventions;
    with `cluster_token` (a worker's port), every call but health must carry the cluster credential;
    `require_client_cert` (with tls.ca_file) turns mutual TLS on for this port; `options` add to or
    override SERVER_OPTIONS (a KV receiver's keepalive pings)."""

    def __init__(self, host: str, port: int, *, long_calls: int = 32, tls: TLSSettings | None = None,
                 require_client_cert: bool = True, interceptors=(), cluster_token: str | None = None,
                 options=()):
        # A call holds a thread for its whole life. `long_calls` bounds those that last (a client's
        # request, a decode stream, a queued prompt); the role refuses more. The short ones get
        # threads of their own: a decode worker full of streams waiting for KV must still take
        # the KV pushes they wait for, and answer load polls and health checks.
        workers = long_calls + SHORT_CALL_THREADS
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                                  options=merge_options(SERVER_OPTIONS, options),
                                  interceptors=[*interceptors, *([ClusterTokenInterceptor(cluster_token)] if cluster_token
                                                                 else []), CallConventions()])
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        address = f"{host}:{port}"
        if tls is not None and tls.enabled:
            self.port = self.server.add_secure_port(address, server_credentials(tls, require_client_cert))
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {address}; is the port in use?")
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self._stopped = threading.Event()
        self.extra_stops: list = []  # what else this process serves (the router's HTTP API), stopped with it

    def add_service(self, full_name: str) -> None:
        self._service_names.append(full_name)

    def start(self) -> "GrpcServer":
        reflection.enable_server_reflection(self._service_names, self.server)
        self.server.start()
        return self

    def set_serving(self) -> None:
        for name in ["", *self._service_names]:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float = 5.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        for stop in self.extra_stops:
            stop()
        self._stopped.set()

    def wait_for_signal(self, on_stop=None, drain=None, drain_timeout_s: float | None = None) -> None:
        """Serve until SIGTERM or SIGINT; then report NOT_SERVING, let `drain()` finish or hand off
        the work in hand, and stop. With `drain_timeout_s` (the drain's own limit), the whole stop
        is bounded: past it and lifeline.STOP_S more, the process says where its threads are and
        exits (a handler blocked on something the stop cannot interrupt held a drained worker
        for minutes)."""
        lifeline.wait_for_stop_signal()
        if drain_timeout_s is not None:
            lifeline.bound_exit(0, drain_timeout_s + lifeline.STOP_S,
                                why="the drain and the stops have taken {seconds:.0f}s since the signal")
        log.info("draining")
        for name in ["", *self._service_names]:
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if drain is not None:
            drain()
        log.info("shutting down")
        if on_stop is not None:
            on_stop()
        self.stop()
