"""What every Baton gRPC process shares: server options, health, reflection, TLS, shutdown."""
from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from baton.config import TLSSettings

log = logging.getLogger(__name__)

# KV chunks are a few MB; prompts and token streams are small. Bounded either way.
MAX_MESSAGE_BYTES = 16 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


def channel(target: str, tls: TLSSettings | None = None) -> grpc.Channel:
    if tls is not None and tls.ca_file:
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(tls.ca_file).read_bytes(),
            private_key=Path(tls.key_file).read_bytes() if tls.key_file else None,
            certificate_chain=Path(tls.cert_file).read_bytes() if tls.cert_file else None,
        )
        return grpc.secure_channel(target, creds, options=GRPC_OPTIONS)
    return grpc.insecure_channel(target, options=GRPC_OPTIONS)


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


class GrpcServer:
    """A gRPC server with the stock health service (NOT_SERVING until `set_serving`) and reflection."""

    def __init__(self, host: str, port: int, *, max_workers: int = 64, tls: TLSSettings | None = None):
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=GRPC_OPTIONS)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        address = f"{host}:{port}"
        if tls is not None and tls.cert_file:
            creds = grpc.ssl_server_credentials(
                [(Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())],
                root_certificates=Path(tls.ca_file).read_bytes() if tls.ca_file else None,
                require_client_auth=bool(tls.ca_file),
            )
            self.port = self.server.add_secure_port(address, creds)
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {address}; is the port in use?")
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self._stopped = threading.Event()

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
        self._stopped.set()

    def wait_for_signal(self, on_stop=None) -> None:
        """Serve until SIGTERM or SIGINT, then drain gracefully."""
        done = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: done.set())
        done.wait()
        log.info("shutting down")
        if on_stop is not None:
            on_stop()
        self.stop()
