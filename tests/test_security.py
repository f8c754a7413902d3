"""TLS, mutual TLS and the bearer token, on a real cluster of processes (tiny-random model).

Certificates are made here with the openssl command line: a CA; one certificate per Baton
process (server and client use, for 127.0.0.1 and localhost), shared by the three roles; a
client-only certificate for API users; and a second, untrusted CA with its own client
certificate. Every process serves mutual TLS; the router also requires a bearer token.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from baton.auth import CLUSTER_TOKEN_KEY, TOKEN_ENV, BearerTokenInterceptor, load_cluster_token, load_token
from baton.config import TLSSettings, load_settings
from baton.server import channel
from baton.transport import MAX_MESSAGE_BYTES
from baton.launch.up import LocalCluster, free_port, stop_process, wait_serving
from baton.v1 import (common_pb2, kvtransfer_pb2, kvtransfer_pb2_grpc, router_pb2, router_pb2_grpc, workers_pb2,
                      workers_pb2_grpc)
from baton.client import BatonClient, Unauthenticated, Unavailable

TOKEN = "baton-test-token-6f1d2c8a9b"
REPO = Path(__file__).resolve().parent.parent


# --- certificates --------------------------------------------------------------------------------

def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(folder, name: str) -> None:
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    openssl("req", "-x509", *key, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1",
            "-subj", f"/CN={name}", cwd=folder)


def make_cert(folder, name: str, ca: str, extensions: str) -> None:
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    (folder / f"{name}.ext").write_text(extensions)
    openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=baton-{name}", cwd=folder)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=folder)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("the TLS tests make their certificates with the `openssl` command, which is not installed")
    folder = tmp_path_factory.mktemp("pki")
    make_ca(folder, "ca")
    make_ca(folder, "rogue-ca")
    # Each process presents its certificate both ways: serving, and toward the other components.
    make_cert(folder, "node", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                    "extendedKeyUsage=serverAuth,clientAuth\n")
    make_cert(folder, "user", "ca", "extendedKeyUsage=clientAuth\n")
    make_cert(folder, "rogue-user", "rogue-ca", "extendedKeyUsage=clientAuth\n")
    (folder / "token").write_text(TOKEN + "\n")
    return folder


def node_tls(pki) -> TLSSettings:
    return TLSSettings(cert_file=str(pki / "node.pem"), key_file=str(pki / "node.key"), ca_file=str(pki / "ca.pem"))


def user_client(pki, address: str, **kwargs) -> BatonClient:
    """An API user with a certificate from the cluster's CA; keywords override."""
    options = dict(tls=True, root_certificates=pki / "ca.pem", client_cert=pki / "user.pem",
                   client_key=pki / "user.key", token=TOKEN, timeout=60)
    options.update(kwargs)
    return BatonClient(address, **options)


# --- the cluster ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(pki):
    with LocalCluster(prefill=1, decode=1, model="tiny-random", tls=node_tls(pki),
                      auth_token_file=str(pki / "token"), http_port=-1) as running:
        yield running


@pytest.fixture(scope="module")
def public_router(pki, cluster):
    """A second router over the same workers whose public port is server-side TLS only."""
    address = f"127.0.0.1:{free_port()}"
    tls = node_tls(pki)
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton.cli", "router", "--host", "127.0.0.1", "--port", address.split(":")[1],
         "--model", "tiny-random", "--prefill-workers", ",".join(cluster.prefill_addrs),
         "--decode-workers", ",".join(cluster.decode_addrs), "--tls-cert", tls.cert_file, "--tls-key", tls.key_file,
         "--tls-ca", tls.ca_file, "--no-require-client-cert", "--auth-token-file", str(pki / "token"),
         "--http-port", "0"],
        env=dict(os.environ, BATON_CLUSTER_TOKEN=cluster.cluster_token), start_new_session=True)
    try:
        wait_serving(address, proc, 120, tls)
        yield address
    finally:
        stop_process(proc)


def raw_secure_channel(pki, address: str, *, client_cert: str | None = "user", ca: str = "ca",
                       max_send: int | None = None) -> grpc.Channel:
    read = lambda name: (pki / name).read_bytes()  # noqa: E731
    creds = grpc.ssl_channel_credentials(
        root_certificates=read(f"{ca}.pem"),
        private_key=read(f"{client_cert}.key") if client_cert else None,
        certificate_chain=read(f"{client_cert}.pem") if client_cert else None)
    options = [("grpc.max_send_message_length", max_send)] if max_send else []
    return grpc.secure_channel(address, creds, options=options)


@pytest.mark.slow
def test_tls_cluster_serves_requests_end_to_end(pki, cluster, tiny_reference):
    """Router -> workers and prefill -> decode (the KV push) all run over mutual TLS: the workers
    refuse anything else (next test), yet requests finish with the reference model's tokens."""
    with user_client(pki, cluster.router_address) as client:
        result = client.generate("The quick brown fox", max_tokens=12, ignore_eos=True)
        assert result.token_ids == tiny_reference.greedy(result.prompt_token_ids, 12)
        streamed = [t for chunk in client.stream("Hello over TLS", max_tokens=6, ignore_eos=True)
                    for t in chunk.token_ids]
        assert len(streamed) == 6
        assert client.model_info().max_context > 0
        workers = client.cluster_status().workers
    assert {w.address for w in workers} == set(cluster.prefill_addrs + cluster.decode_addrs)
    assert all(w.healthy for w in workers), "the router's load polls (over TLS) reached every worker"
    assert result.trace.decode_worker == cluster.decode_addrs[0]


@pytest.mark.slow
def test_workers_accept_only_mutual_tls_peers(pki, cluster):
    request = health_pb2.HealthCheckRequest()
    for address in cluster.prefill_addrs + cluster.decode_addrs:
        with channel(address, node_tls(pki)) as ch:  # what the router and prefill workers use
            assert health_pb2_grpc.HealthStub(ch).Check(request, timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
        attempts = {
            "plaintext": grpc.insecure_channel(address),
            "TLS without a client certificate": raw_secure_channel(pki, address, client_cert=None),
            "a client certificate from another CA": raw_secure_channel(pki, address, client_cert="rogue-user"),
        }
        for what, ch in attempts.items():
            with ch, pytest.raises(grpc.RpcError) as err:
                health_pb2_grpc.HealthStub(ch).Check(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, f"{address} accepted {what}"


@pytest.mark.slow
def test_mutual_tls_router_refuses_clients_without_a_trusted_certificate(pki, cluster):
    address = cluster.router_address
    refused = {
        "plaintext": dict(tls=False, root_certificates=None, client_cert=None, client_key=None),
        "no client certificate": dict(client_cert=None, client_key=None),
        "a client certificate from another CA": dict(client_cert=pki / "rogue-user.pem",
                                                     client_key=pki / "rogue-user.key"),
        "a server certificate it cannot verify": dict(root_certificates=pki / "rogue-ca.pem"),
    }
    for what, overrides in refused.items():
        with user_client(pki, address, timeout=10, **overrides) as client, pytest.raises(Unavailable):
            client.generate("should not get through", max_tokens=2)
            pytest.fail(f"the router served a client with {what}")


@pytest.mark.slow
@pytest.mark.parametrize("authorization, message", [
    (None, "requires a bearer token"),
    (f"Bearer {TOKEN}x", "not valid"),
    ("Bearer ", "not valid"),
    (f"bearer {TOKEN}", "must be 'Bearer <token>'"),
    (f"Basic {TOKEN}", "must be 'Bearer <token>'"),
])
def test_every_router_rpc_refuses_a_missing_or_wrong_token(pki, cluster, authorization, message):
    metadata = (("authorization", authorization),) if authorization is not None else ()
    with raw_secure_channel(pki, cluster.router_address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        request = router_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=2))
        calls = {
            "Generate": lambda: list(stub.Generate(request, metadata=metadata, timeout=10)),
            "GenerateBatch": lambda: list(stub.GenerateBatch(router_pb2.GenerateBatchRequest(requests=[request]),
                                                             metadata=metadata, timeout=10)),
            "GetModelInfo": lambda: stub.GetModelInfo(router_pb2.ModelInfoRequest(), metadata=metadata, timeout=10),
            "GetClusterStatus": lambda: stub.GetClusterStatus(router_pb2.ClusterStatusRequest(), metadata=metadata,
                                                              timeout=10),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert message in err.value.details(), name


@pytest.mark.slow
def test_the_right_token_works_and_the_sdk_reports_wrong_ones(pki, cluster):
    with user_client(pki, cluster.router_address) as client:
        assert client.generate("token ok", max_tokens=3, ignore_eos=True).finish_reason == "length"
    for token in (None, "not-the-token"):
        with user_client(pki, cluster.router_address, token=token) as client, pytest.raises(Unauthenticated):
            client.generate("no entry", max_tokens=3)


@pytest.mark.slow
def test_the_openai_api_speaks_the_same_mutual_tls_and_token(pki, cluster):
    """The HTTP API serves the router's certificate, demands a client certificate from the same CA,
    and the same bearer token."""
    import ssl
    import urllib.error
    import urllib.request

    assert cluster.http_url.startswith("https://127.0.0.1:")

    def get(path: str, *, client_cert: str | None = "user", token: str | None = TOKEN):
        context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        if client_cert:
            context.load_cert_chain(str(pki / f"{client_cert}.pem"), str(pki / f"{client_cert}.key"))
        request = urllib.request.Request(cluster.http_url + path)
        if token:
            request.add_header("authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, context=context, timeout=30) as response:
            return response.status, json.loads(response.read())

    status, models = get("/models")
    assert status == 200 and models["data"][0]["id"] == "tiny-random"
    with pytest.raises(urllib.error.HTTPError) as refused:
        get("/models", token="wrong")
    assert refused.value.code == 401
    for untrusted in (None, "rogue-user"):
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            get("/models", client_cert=untrusted)


def test_health_and_reflection_need_no_token(pki, cluster):
    with raw_secure_channel(pki, cluster.router_address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="baton.v1.Router"), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        services = {s.name for reply in replies for s in reply.list_services_response.service}
    assert "baton.v1.Router" in services


@pytest.mark.slow
def test_server_side_tls_router_takes_a_token_without_a_client_certificate(pki, public_router):
    no_cert = dict(client_cert=None, client_key=None)
    with user_client(pki, public_router, **no_cert) as client:
        assert len(client.generate("server-side TLS", max_tokens=4, ignore_eos=True).token_ids) == 4
    with user_client(pki, public_router, token=None, **no_cert) as client, pytest.raises(Unauthenticated):
        client.generate("server-side TLS, no token", max_tokens=2)
    with user_client(pki, public_router, tls=False, root_certificates=None, **no_cert) as client:
        with pytest.raises(Unavailable):
            client.generate("plaintext", max_tokens=2)


@pytest.mark.slow
def test_oversized_messages_are_resource_exhausted_and_processes_stay_up(pki, cluster):
    oversized = MAX_MESSAGE_BYTES + (1 << 20)
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    with raw_secure_channel(pki, cluster.router_address, max_send=2 * oversized) as ch:
        request = router_pb2.GenerateRequest(text="a" * oversized)
        with pytest.raises(grpc.RpcError) as err:
            list(router_pb2_grpc.RouterStub(ch).Generate(request, metadata=metadata, timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    decode = cluster.decode_addrs[0]
    with raw_secure_channel(pki, decode, client_cert="node", max_send=2 * oversized) as ch:
        chunk = kvtransfer_pb2.KVChunk(data=kvtransfer_pb2.KVData(payload=b"\0" * oversized))
        with pytest.raises(grpc.RpcError) as err:
            kvtransfer_pb2_grpc.KVTransferStub(ch).Push(iter([chunk]), timeout=30,
                                                        metadata=[(CLUSTER_TOKEN_KEY, cluster.cluster_token)])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with user_client(pki, cluster.router_address) as client:
        assert len(client.generate("still up", max_tokens=3, ignore_eos=True).token_ids) == 3


@pytest.mark.slow
def test_generate_command_line_speaks_mutual_tls_with_a_token_file(pki, cluster):
    base = [sys.executable, "-m", "baton.cli", "generate", "--router", cluster.router_address, "--max-tokens", "3",
            "--json"]
    tls = ["--ca", str(pki / "ca.pem"), "--cert", str(pki / "user.pem"), "--key", str(pki / "user.key")]
    done = subprocess.run([*base, *tls, "--token-file", str(pki / "token"), "Hi"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert '"finish_reason"' in done.stdout
    refused = subprocess.run([*base, *tls, "Hi"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr


# --- without processes ---------------------------------------------------------------------------

def test_token_comes_from_a_file_or_the_environment(tmp_path):
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    assert load_token(str(path), {}) == TOKEN
    assert load_token("", {TOKEN_ENV: TOKEN}) == TOKEN
    assert load_token("", {}) is None
    with pytest.raises(ValueError, match="keep one"):
        load_token(str(path), {TOKEN_ENV: TOKEN})
    with pytest.raises(ValueError, match="cannot read"):
        load_token(str(tmp_path / "missing"), {})
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_token(str(path), {})
    path.write_text("two words")
    with pytest.raises(ValueError, match="printable ASCII without spaces"):
        load_token(str(path), {})
    with pytest.raises(ValueError, match="printable ASCII"):
        BearerTokenInterceptor("t\u00f6ken")


def test_half_a_tls_setup_is_refused_when_settings_load(tmp_path):
    for env, message in [({"BATON_TLS_CERT_FILE": "/c.pem"}, "go together"),
                         ({"BATON_TLS_KEY_FILE": "/k.pem"}, "go together"),
                         ({"BATON_TLS_CA_FILE": "/ca.pem"}, "needs tls.cert_file")]:
        with pytest.raises(ValueError, match=message):
            load_settings(env=env)
    settings = load_settings(env={"BATON_ROUTER_AUTH_TOKEN_FILE": "/run/token",
                                  "BATON_ROUTER_REQUIRE_CLIENT_CERT": "false"})
    assert settings.router.auth_token_file == "/run/token" and settings.router.require_client_cert is False
    assert not settings.tls.enabled


def test_router_with_an_unreadable_token_file_exits_with_a_message(tmp_path, capsys):
    from baton.cli import main

    assert main(["router", "--port", str(free_port()), "--model", "tiny-random",
                 "--auth-token-file", str(tmp_path / "missing")]) == 2  # before it listens or loads anything
    assert "router.auth_token_file: cannot read" in capsys.readouterr().err


def test_missing_certificate_file_is_named(tmp_path):
    tls = TLSSettings(cert_file=str(tmp_path / "none.pem"), key_file=str(tmp_path / "none.key"))
    with pytest.raises(ValueError, match="tls.key_file: cannot read"):
        channel("127.0.0.1:1", tls)


# --- a certificate that names only a DNS name, peers dialled by IP ------------------------------

DNS_ONLY_NAME = "workers.baton.internal"


@pytest.fixture(scope="module")
def dns_only_tls(pki) -> TLSSettings:
    """A node certificate naming only a DNS name (no IP, no localhost), as a cert-manager
    certificate for a Kubernetes Service would; every process dials the others by 127.0.0.1."""
    make_cert(pki, "dns-node", "ca", f"subjectAltName=DNS:{DNS_ONLY_NAME}\n"
                                     "extendedKeyUsage=serverAuth,clientAuth\n")
    return TLSSettings(cert_file=str(pki / "dns-node.pem"), key_file=str(pki / "dns-node.key"),
                       ca_file=str(pki / "ca.pem"), server_name=DNS_ONLY_NAME)


@pytest.mark.slow
def test_tls_cluster_dialled_by_ip_checks_certificates_for_the_server_name(pki, dns_only_tls, tiny_reference):
    """Router -> workers and the prefill -> decode KV push go to IP addresses the certificate does
    not name; tls.server_name (--tls-server-name, gRPC's ssl_target_name_override) makes them
    check it for its DNS name instead, and requests finish exactly."""
    with LocalCluster(prefill=1, decode=1, model="tiny-random", tls=dns_only_tls) as cluster:
        without_override = TLSSettings(cert_file=dns_only_tls.cert_file, key_file=dns_only_tls.key_file,
                                       ca_file=dns_only_tls.ca_file)
        request = health_pb2.HealthCheckRequest()
        for address in cluster.prefill_addrs + cluster.decode_addrs:
            # The name check is real: dialled by IP without the override, the handshake fails...
            with channel(address, without_override) as ch, pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(ch).Check(request, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            # ...and a different name is refused too, so the override is checked, not skipped.
            wrong = TLSSettings(cert_file=dns_only_tls.cert_file, key_file=dns_only_tls.key_file,
                                ca_file=dns_only_tls.ca_file, server_name="someone-else.internal")
            with channel(address, wrong) as ch, pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(ch).Check(request, timeout=5)
        with user_client(pki, cluster.router_address, token=None, tls_server_name=DNS_ONLY_NAME) as client:
            result = client.generate(token_ids=[11, 12, 13, 14, 15], max_tokens=10, ignore_eos=True)
            workers = client.cluster_status().workers
    assert result.token_ids == tiny_reference.greedy([11, 12, 13, 14, 15], 10)
    assert result.trace.decode_worker == cluster.decode_addrs[0]  # the KV went over TLS to an IP
    assert all(w.healthy for w in workers), "the router's load polls reached every worker by IP"


def test_tls_server_name_is_validated_and_becomes_a_channel_option(pki):
    from baton.server import CHANNEL_OPTIONS, tls_channel_options

    with pytest.raises(ValueError, match="tls.server_name applies to TLS channels only"):
        load_settings(env={"BATON_TLS_SERVER_NAME": DNS_ONLY_NAME})
    for bad in ("10.0.0.1:50071", "two names", "https://x"):
        with pytest.raises(ValueError, match="tls.server_name must be a bare host name"):
            load_settings(env={"BATON_TLS_CERT_FILE": "/c.pem", "BATON_TLS_KEY_FILE": "/k.pem",
                               "BATON_TLS_SERVER_NAME": bad})
    settings = load_settings(env={"BATON_TLS_CERT_FILE": "/c.pem", "BATON_TLS_KEY_FILE": "/k.pem",
                                  "BATON_TLS_SERVER_NAME": DNS_ONLY_NAME})
    assert ("grpc.ssl_target_name_override", DNS_ONLY_NAME) in tls_channel_options(settings.tls)
    assert tls_channel_options(TLSSettings(cert_file="/c.pem", key_file="/k.pem")) == CHANNEL_OPTIONS
    from baton.cli import build_parser, load_role_settings

    args = build_parser().parse_args(["prefill", "--tls-cert", "/c.pem", "--tls-key", "/k.pem",
                                      "--tls-server-name", DNS_ONLY_NAME])
    assert load_role_settings(args).tls.server_name == DNS_ONLY_NAME


# --- the cluster credential: worker ports answer only the router and other workers --------------

def worker_methods() -> list[tuple[str, bool, bool]]:
    """(path, client streams, server streams) of every RPC a prefill or decode worker serves."""
    services = [workers_pb2.DESCRIPTOR.services_by_name["PrefillWorker"],
                workers_pb2.DESCRIPTOR.services_by_name["DecodeWorker"],
                kvtransfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"]]
    return [(f"/{service.full_name}/{method.name}", method.client_streaming, method.server_streaming)
            for service in services for method in service.methods]


def call_raw(ch: grpc.Channel, path: str, client_streams: bool, server_streams: bool, metadata=()) -> grpc.StatusCode:
    """Calls `path` with an empty message, never parsed if the caller is refused; the status."""
    raw = dict(request_serializer=None, response_deserializer=None)
    make = {(False, False): ch.unary_unary, (False, True): ch.unary_stream,
            (True, False): ch.stream_unary, (True, True): ch.stream_stream}[client_streams, server_streams]
    request = iter([b""]) if client_streams else b""
    try:
        reply = make(path, **raw)(request, timeout=10, metadata=metadata)
        if server_streams:
            list(reply)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def assert_worker_rpcs_need_the_cluster_token(addresses, open_channel, token) -> None:
    methods = worker_methods()
    assert {"/baton.v1.PrefillWorker/Prefill", "/baton.v1.PrefillWorker/PinPrefix", "/baton.v1.DecodeWorker/Decode",
            "/baton.v1.DecodeWorker/Handoff", "/baton.v1.PrefillWorker/Cancel", "/baton.v1.KVTransfer/Push",
            "/baton.v1.PrefillWorker/GetLoad"} <= {path for path, _, _ in methods}
    for address in addresses:
        for path, client_streams, server_streams in methods:
            for what, metadata in {"no cluster token": (), "a wrong cluster token": ((CLUSTER_TOKEN_KEY, "x" * 64),),
                                   "the client's bearer token": (("authorization", f"Bearer {TOKEN}"),)}.items():
                with open_channel(address) as ch:
                    code = call_raw(ch, path, client_streams, server_streams, metadata)
                assert code == grpc.StatusCode.UNAUTHENTICATED, f"{address} {path} answered {code} with {what}"
    # The credential itself opens them: a load poll as the router makes it (addresses[0] is a prefill worker).
    with open_channel(addresses[0]) as ch:
        assert call_raw(ch, "/baton.v1.PrefillWorker/GetLoad", False, False, ((CLUSTER_TOKEN_KEY, token),)) == \
            grpc.StatusCode.OK


@pytest.fixture(scope="module")
def plain_cluster():
    with LocalCluster(prefill=1, decode=1, model="tiny-random") as running:
        yield running


@pytest.mark.slow
def test_worker_ports_refuse_every_call_without_the_cluster_token(plain_cluster, tiny_reference):
    assert_worker_rpcs_need_the_cluster_token(plain_cluster.prefill_addrs + plain_cluster.decode_addrs,
                                              grpc.insecure_channel, plain_cluster.cluster_token)
    with BatonClient(plain_cluster.router_address, timeout=60) as client:  # the router holds it
        result = client.generate(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
    assert result.token_ids == tiny_reference.greedy([5, 6, 7], 4)


@pytest.mark.slow
def test_a_client_certificate_from_the_clusters_ca_opens_no_worker_port(pki, cluster):
    """Mutual TLS authenticates the peer; only the cluster token says it is the router or a worker."""
    assert_worker_rpcs_need_the_cluster_token(cluster.prefill_addrs + cluster.decode_addrs,
                                              lambda address: raw_secure_channel(pki, address, client_cert="user"),
                                              cluster.cluster_token)


@pytest.mark.slow
def test_prefill_refuses_a_decode_target_outside_the_cluster(plain_cluster):
    prefill = plain_cluster.prefill_addrs[0]
    token = ((CLUSTER_TOKEN_KEY, plain_cluster.cluster_token),)
    with grpc.insecure_channel(prefill) as ch:
        stub = workers_pb2_grpc.PrefillWorkerStub(ch)
        for target, code in [("127.0.0.1:1", grpc.StatusCode.PERMISSION_DENIED),  # a port scan, an SSRF
                             ("10.0.0.7:6379", grpc.StatusCode.PERMISSION_DENIED),
                             ("http://127.0.0.1:80/", grpc.StatusCode.INVALID_ARGUMENT),
                             ("127.0.0.1:99999", grpc.StatusCode.INVALID_ARGUMENT)]:
            request = workers_pb2.PrefillRequest(request_id="outside", prompt_token_ids=[5, 6, 7], decode_target=target,
                                                 sampling=common_pb2.SamplingParams(max_tokens=2))
            with pytest.raises(grpc.RpcError) as err:
                stub.Prefill(request, timeout=10, metadata=token)
            assert err.value.code() == code, target
            assert target[:20] in err.value.details()


def test_the_cluster_token_comes_from_one_place():
    assert load_cluster_token("", "") is None
    assert load_cluster_token(" abc ", "") == "abc"
    with pytest.raises(ValueError, match="keep one"):
        load_cluster_token("abc", "/some/file")
    with pytest.raises(ValueError, match="cluster.token_file: cannot read"):
        load_cluster_token("", "/no/such/file")
    with pytest.raises(ValueError, match="printable ASCII"):
        load_cluster_token("a b", "")
    assert load_settings(env={"BATON_CLUSTER_TOKEN": "t0k3n"}).cluster.token == "t0k3n"


def test_a_bare_worker_without_a_cluster_token_listens_only_on_loopback_unless_told_insecure(caplog):
    """Started bare on a reachable address with no cluster token, a worker refuses to start (before
    it binds anything) and says how to fix it; on loopback (one machine) or with --insecure it serves."""
    from baton.config import ClusterSettings
    from baton.server import cluster_token

    env = {k: v for k, v in os.environ.items() if k not in ("BATON_CLUSTER_TOKEN", "BATON_CLUSTER_TOKEN_FILE")}
    for role in ("prefill", "decode"):
        refused = subprocess.run([sys.executable, "-m", "baton.cli", role, "--host", "0.0.0.0", "--port",
                                  str(free_port()), "--model", "tiny-random"],
                                 env=env, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2, refused.stderr
        assert f"this {role} worker would listen on 0.0.0.0 with no cluster token" in refused.stderr
        assert "BATON_CLUSTER_TOKEN" in refused.stderr and "--insecure" in refused.stderr
        assert "Traceback" not in refused.stderr
    for host in ("127.0.0.1", "::1", "localhost", "[::1]"):
        assert cluster_token(None, "decode", host) is None  # development on one machine stays open
    for host in ("0.0.0.0", "10.1.2.3", "::", "decode.baton.svc"):
        with pytest.raises(ValueError, match="no cluster token"):
            cluster_token(ClusterSettings(), "prefill", host)
        assert cluster_token(ClusterSettings(insecure=True), "prefill", host) is None
    assert "answers anyone who can reach decode.baton.svc" in caplog.text
    assert cluster_token(ClusterSettings(token="t" * 32), "decode", "0.0.0.0") == "t" * 32
    assert cluster_token(None, "router", "0.0.0.0") is None  # the router's public port has its own token
