"""`baton up`: router, prefill and decode workers as real processes on loopback (or each in a
host of its own: LocalCluster's `hosts`).

Prints one line with `ready` and the router address once every process serves; Ctrl-C or
SIGTERM stops them all. `--demo` sends a short mixed workload through the SDK and stops.
"""
from __future__ import annotations

import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.auth import CLUSTER_TOKEN_ENV
from baton.config import TLSSettings
from baton.lifeline import PARENT_ENV, StopSignals  # the processes Baton starts die with it
from baton.server import channel
from baton.engine.threads import split_cores
from baton.launch.forkserver import FORKSERVER_ENV, ForkedProcess, forkserver
from baton.launch.netns import Hosts
from baton.router.discovery.file import POLL_S, write_workers_file

STARTUP_TIMEOUT_S = 600  # the first start converts the default model


def free_port() -> int:
    """A loopback port nothing listens on, for a process started next to bind.

    Drawn below the kernel's ephemeral range: a port from that range (what binding to port 0
    gives) can be taken by any outgoing connection before the process gets to bind it."""
    low = _ephemeral_ports_start()
    for _ in range(200):
        port = random.randrange(FIXED_PORTS_START, low) if low - FIXED_PORTS_START > 1000 else 0
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        _handed_out.add(port)
        return port
    raise OSError("no free loopback port found")


FIXED_PORTS_START = 20000
_handed_out: set[int] = set()  # never the same port twice from one process


def _ephemeral_ports_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere a port is drawn from below it all the same


def _poll(address: str, proc: subprocess.Popen, timeout: float, tls: TLSSettings | None, ready, not_ready: str,
          every_s: float) -> None:
    """Call ready(channel) every every_s seconds until it is true; the process exiting or the
    timeout passing first raise, saying which."""
    deadline = time.monotonic() + timeout
    with channel(address, tls) as ch:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the process for {address} exited with status {proc.returncode}")
            try:
                if ready(ch):
                    return
            except grpc.RpcError:
                pass
            time.sleep(every_s)
    raise TimeoutError(f"{not_ready} within {timeout:.0f}s")


def wait_serving(address: str, proc: subprocess.Popen, timeout: float, tls: TLSSettings | None = None) -> None:
    """Poll the process's health service (over TLS with tls's certificate) until it is SERVING."""
    def serving(ch) -> bool:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status
        return status == health_pb2.HealthCheckResponse.SERVING

    _poll(address, proc, timeout, tls, serving, f"{address} did not become ready", 0.2)


def wait_routed(address: str, proc: subprocess.Popen, workers: list[str], timeout: float,
                tls: TLSSettings | None = None, token_file: str = "") -> None:
    """Poll the router's cluster status until its load poll has found every one of `workers`
    healthy and its prefix index follows every prefill worker's cache: a router started beside its
    workers first reached them before they served."""
    from baton.v1 import router_pb2, router_pb2_grpc

    metadata = (("authorization", f"Bearer {Path(token_file).read_text().strip()}"),) if token_file else ()

    def routed(ch) -> bool:
        status = router_pb2_grpc.RouterStub(ch).GetClusterStatus(router_pb2.ClusterStatusRequest(), timeout=1,
                                                                 metadata=metadata)
        return set(workers) <= {w.address for w in status.workers
                                 if w.healthy and w.cache_synced}

    _poll(address, proc, timeout, tls, routed, f"the router at {address} did not find its workers healthy", 0.1)


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM (the process drains), then SIGKILL if it is still there after timeout; its status."""
    proc.terminate()
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


class LocalCluster:
    """Starts and stops the processes; usable from tests and benchmarks as a context manager.

    With `tls`, every process serves TLS with that certificate and uses it toward the others (its
    ca_file turns on mutual TLS); `auth_token_file` makes the routers require that bearer token. The
    workers answer only calls carrying the cluster token (`cluster_token`), which every process of
    the cluster is given and no client is.

    With `hosts` (started, holding every name of `host_names(prefill, decode)`), each process runs
    in its host's network namespace and listens on that host's address: the routers in "router",
    the workers in "prefill" and "decode", or "prefill0", "prefill1", ... where there are several.
    Every address the cluster hands out is then a host's, which this process reaches too."""

    def __init__(self, *, port: int = 0, prefill: int = 1, decode: int = 1, model: str = "default",
                 max_rows: int = 8, extra_env: dict | None = None, log_level: str = "WARNING", routers: int = 1,
                 start_lines: bool = False,
                 router_args: tuple[str, ...] = (), prefill_args: tuple[str, ...] = (),
                 decode_args: tuple[str, ...] = (), tls: TLSSettings | None = None, auth_token_file: str = "",
                 share_cores: bool = False, http_port: int = 0, hosts: Hosts | None = None,
                 dynamic: bool = False):
        if prefill < 1 or decode < 1:
            raise ValueError(f"need at least one prefill and one decode worker (got {prefill}, {decode})")
        if max_rows < 0:
            raise ValueError(f"max_rows must be >= 0 (got {max_rows}; 0: each decode worker sizes it at start)")
        self.hosts = hosts
        names = self.host_names(prefill, decode)
        if hosts is not None and set(names) - set(hosts.names):
            raise ValueError(f"hosts lacks {sorted(set(names) - set(hosts.names))} (a cluster of {prefill} prefill "
                             f"and {decode} decode workers runs in hosts {names})")
        if tls is not None:
            tls.validate()
        self.tls = tls if tls is not None and tls.enabled else None
        security = ()
        if self.tls is not None:
            security = ("--tls-cert", self.tls.cert_file, "--tls-key", self.tls.key_file)
            security += ("--tls-ca", self.tls.ca_file) if self.tls.ca_file else ()
            security += ("--tls-server-name", self.tls.server_name) if self.tls.server_name else ()
        prefill_args, decode_args = security + tuple(prefill_args), security + tuple(decode_args)
        auth = ("--auth-token-file", auth_token_file) if auth_token_file else ()
        self.auth_token_file = auth_token_file
        router_args = security + auth + tuple(router_args)
        # Each address's host; free_port() probes the root namespace, and in a host of its own any port is free.
        self.host_of: dict[str, str] = {}

        def address(host: str, port: int = 0) -> str:
            addr = f"{hosts.address(host) if hosts else '127.0.0.1'}:{port or free_port()}"
            self.host_of[addr] = host
            return addr

        self.router_addresses = [address("router", port)] + [address("router") for _ in range(routers - 1)]
        self.router_args, self.prefill_args, self.decode_args = router_args, prefill_args, decode_args
        self.prefill_addrs = [address(names[1 + i]) for i in range(prefill)]
        self.decode_addrs = [address(names[1 + prefill + i]) for i in range(decode)]
        # The first router also serves the OpenAI HTTP API on `http_port` (-1: a free port; 0: off).
        self.http_port = free_port() if http_port < 0 else http_port
        self.model = model
        self.max_rows = max_rows
        self.env = dict(os.environ, **(extra_env or {}))
        # The cluster credential: workers answer only the router and each other (baton/auth.py).
        # One given in the environment is shared; otherwise each cluster makes its own.
        self.cluster_token = self.env.get(CLUSTER_TOKEN_ENV) or secrets.token_hex(32)
        self.env[CLUSTER_TOKEN_ENV] = self.cluster_token
        # Prefill workers push KV only to this cluster's decode workers. With `dynamic`, workers come
        # and go (add_worker, remove_worker): the router and the prefill workers follow a workers
        # file this cluster rewrites (file discovery) instead of fixed lists.
        self.workers_file = ""
        if dynamic:
            self._workers_dir = tempfile.TemporaryDirectory(prefix="baton-up-")
            self.workers_file = os.path.join(self._workers_dir.name, "workers.json")
            self.env.update(BATON_PREFILL_DISCOVERY="file", BATON_PREFILL_WORKERS_FILE=self.workers_file)
            self._write_workers()
        else:
            self.env["BATON_PREFILL_DECODE_WORKERS"] = ",".join(self.decode_addrs)
        # With share_cores, each worker is bound to its own cores (as vLLM binds its CPU workers), so
        # prefill and decode run side by side instead of every process spinning a thread on every
        # core; with fewer cores than workers they share them, one thread each. OMP_NUM_THREADS in
        # the environment wins.
        self.worker_args: list[tuple[str, ...]] = [()] * (prefill + decode)
        if share_cores and "OMP_NUM_THREADS" not in self.env:
            self.worker_args = [("--cpu-cores", cores) if cores else ("--threads", "1")
                                 for cores in split_cores(prefill + decode)]
        self.log_level = log_level
        self.start_lines = start_lines  # the workers' start-up lines (loading, sizes chosen), as `baton up` shows
        self.procs: list[tuple[str, subprocess.Popen]] = []

    @staticmethod
    def host_names(prefill: int = 1, decode: int = 1) -> list[str]:
        """The hosts a cluster of `prefill` and `decode` workers runs in: the router's, then the
        workers' (a role's name alone for one worker, numbered from 0 for several)."""
        def named(role: str, count: int) -> list[str]:
            return [role] if count == 1 else [f"{role}{i}" for i in range(count)]

        return ["router", *named("prefill", prefill), *named("decode", decode)]

    @property
    def router_address(self) -> str:
        return self.router_addresses[0]

    def role_of(self, address: str) -> str:
        """'prefill', 'decode' or 'router': what the process at `address` serves."""
        return "prefill" if address in self.prefill_addrs else "decode" if address in self.decode_addrs else "router"

    @property
    def http_url(self) -> str:
        """Base URL of the OpenAI API (what `base_url` of the openai package takes), or ''."""
        if not self.http_port:
            return ""
        return f"{'https' if self.tls else 'http'}://{_host(self.router_address)}:{self.http_port}/v1"

    def _spawn(self, address: str, *args: str) -> subprocess.Popen | ForkedProcess:
        """Start the process serving `address` (in that address's host if the cluster has hosts):
        forked from the fork server (launch/forkserver.py), or a fresh interpreter."""
        argv = ["--log-level", self.log_level, *(() if self.start_lines else ("--quiet-start",)), *args]
        if os.environ.get(FORKSERVER_ENV, "1") != "0":
            netns = self.hosts.namespaces[self.host_of[address]] if self.hosts is not None else ""
            return forkserver().start(argv, self.env, netns)
        cmd = [sys.executable, "-m", "baton.cli", *argv]
        if self.hosts is not None:
            cmd = self.hosts.command(self.host_of[address], cmd)  # execs in place: the PID is the process's
        return subprocess.Popen(cmd, env=dict(self.env, **{PARENT_ENV: str(os.getpid())}), start_new_session=True)

    def worker_command(self, address: str) -> list[str]:
        """The `baton.cli` arguments of the worker serving `address`."""
        workers = self.prefill_addrs + self.decode_addrs
        index = workers.index(address)
        role = "prefill" if index < len(self.prefill_addrs) else "decode"
        args = [role, "--host", _host(address), "--port", address.split(":")[1], "--model", self.model]
        if role == "decode" and self.max_rows:  # else the worker sizes its rows
            args += ["--max-rows", str(self.max_rows)]
        return args + [*self.worker_args[index], *(self.prefill_args if role == "prefill" else self.decode_args)]

    def _router_command(self, address: str) -> list[str]:
        """The `baton.cli` arguments of the router serving `address` (the first serves the HTTP API)."""
        workers = (("--discovery", "file", "--workers-file", self.workers_file) if self.workers_file else
                   ("--prefill-workers", ",".join(self.prefill_addrs), "--decode-workers", ",".join(self.decode_addrs)))
        first = address == self.router_addresses[0]
        return ["router", "--host", _host(address), "--port", address.split(":")[1], "--model", self.model, *workers,
                "--http-port", str(self.http_port if first else 0), *self.router_args]

    def _write_workers(self) -> None:
        write_workers_file(self.workers_file, {"prefill": self.prefill_addrs, "decode": self.decode_addrs})

    def add_worker(self, role: str, timeout: float = STARTUP_TIMEOUT_S) -> str:
        """Start one more worker of `role` (a `dynamic` cluster); returns its address once it serves
        and the router and the prefill workers know it."""
        if not self.workers_file:
            raise RuntimeError("add_worker needs a cluster made with dynamic=True")
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        address = f"{_host(self.router_address)}:{free_port()}"
        self.host_of[address] = self.host_of[self.router_address]
        if role == "prefill":
            self.prefill_addrs.append(address)
            self.worker_args.insert(len(self.prefill_addrs) - 1, ("--threads", "1"))
        else:
            self.decode_addrs.append(address)
            self.worker_args.append(("--threads", "1"))
        proc = self._spawn(address, *self.worker_command(address))
        self.procs.append((address, proc))
        try:
            wait_serving(address, proc, timeout, self.tls)
        except BaseException:
            self._forget(address)
            raise
        self._write_workers()
        return address

    def remove_worker(self, address: str, timeout: float = 60.0) -> int:
        """Take a worker out (a `dynamic` cluster): the router and the prefill workers stop
        sending to it, then SIGTERM drains it (a decode worker's requests move to the others with
        their KV) and it exits. Returns its exit status."""
        if not self.workers_file:
            raise RuntimeError("remove_worker needs a cluster made with dynamic=True")
        proc = dict(self.procs)[address]
        pool = self.prefill_addrs if address in self.prefill_addrs else self.decode_addrs
        if len(pool) == 1:
            raise ValueError(f"{address} is its role's last worker; a cluster keeps one of each")
        self._forget(address)
        self._write_workers()
        # The router and the prefill workers read the file every POLL_S: a request routed there
        # meanwhile would find the worker gone (Kubernetes' preStop sleep is the same wait).
        time.sleep(3 * POLL_S)
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def _forget(self, address: str) -> None:
        if address in self.prefill_addrs:
            index = self.prefill_addrs.index(address)
            self.prefill_addrs.remove(address)
        else:
            index = len(self.prefill_addrs) + self.decode_addrs.index(address)
            self.decode_addrs.remove(address)
        del self.worker_args[index]
        self.procs = [(a, p) for a, p in self.procs if a != address]

    def restart(self, address: str, timeout: float = STARTUP_TIMEOUT_S) -> subprocess.Popen:
        """SIGKILL the worker or router at `address` and start it again on the same port (a crashed
        pod coming back); returns once it serves (a router: once it routes to every worker). Call
        it from the thread that started the cluster: a child dies with the thread that spawned it
        (die_with_parent)."""
        old = dict(self.procs)[address]
        old.send_signal(signal.SIGKILL)
        old.wait()
        proc = self._spawn(address, *(self._router_command(address) if address in self.router_addresses
                                      else self.worker_command(address)))
        self.procs = [(a, proc if a == address else p) for a, p in self.procs]
        wait_serving(address, proc, timeout, self.tls)
        if address in self.router_addresses:
            wait_routed(address, proc, self.prefill_addrs + self.decode_addrs, timeout, self.tls, self.auth_token_file)
        return proc

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> "LocalCluster":
        """Routers start beside the workers (their start-up overlaps the workers' model loading);
        ready once every process serves and every router has found every worker healthy and
        follows every prefill worker's cache (wait_routed)."""
        try:
            for addr in self.prefill_addrs + self.decode_addrs:
                self.procs.append((addr, self._spawn(addr, *self.worker_command(addr))))
            routers = []
            for address in self.router_addresses:
                router = self._spawn(address, *self._router_command(address))
                self.procs.append((address, router))
                routers.append((address, router))
            for addr, proc in self.procs:
                wait_serving(addr, proc, timeout, self.tls)
            for address, router in routers:
                wait_routed(address, router, self.prefill_addrs + self.decode_addrs, timeout, self.tls,
                            self.auth_token_file)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        if self.workers_file:
            self._workers_dir.cleanup()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def planner_settings(args):
    """The planner's config and profile from `baton up`'s flags (ValueError for values it refuses)."""
    from baton.planner.policy import Objectives, PlannerConfig, load_profile

    profile = load_profile(args.planner_profile)
    config = PlannerConfig(Objectives(ttft_s=args.ttft_target, itl_s=args.itl_target), min_prefill=args.prefill,
                           max_prefill=args.max_prefill, min_decode=args.decode, max_decode=args.max_decode,
                           interval_s=args.planner_interval, startup_s=args.worker_startup)
    return config, profile


def run_planner(planner, dry_run: bool, cluster: LocalCluster, stop: StopSignals) -> None:
    """The SLO planner over this cluster's workers, in this (the main) thread, until a stop signal."""
    from baton.client import BatonClient
    from baton.planner.policy import Planner
    from baton.planner.service import LocalScaler, PlannerLoop, reading_from

    config, profile = planner
    print(f"planner: TTFT {config.objectives.ttft_s}s, ITL {config.objectives.itl_s}s; prefill workers "
          f"{config.min_prefill}..{config.max_prefill}, decode {config.min_decode}..{config.max_decode}, every "
          f"{config.interval_s}s{' (dry run)' if dry_run else ''}", flush=True)
    with BatonClient(cluster.router_address, timeout=10) as client:
        loop = PlannerLoop(Planner(config, profile), lambda: reading_from(client.cluster_status(), time.monotonic()),
                           LocalScaler(cluster), dry_run=dry_run, say=lambda line: print(line, flush=True))
        loop.run(lambda seconds: stop.wait(timeout=seconds) is not None)


def _host(address: str) -> str:
    return address.rpartition(":")[0]


DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Name three colors.",
    "Give me a short tip for learning to cook.",
    "What is 12 times 12?",
]


def run_demo(address: str, out=sys.stdout, http_url: str = "", model: str = "default") -> None:
    from baton.client import BatonClient

    with BatonClient(address, timeout=300) as client:
        print(f"\n> {DEMO_PROMPTS[0]}", file=out)
        start = time.monotonic()
        first_at = None
        for chunk in client.stream(DEMO_PROMPTS[0], max_tokens=64):
            if first_at is None and chunk.token_ids:
                first_at = time.monotonic()
            print(chunk.text_delta, end="", flush=True, file=out)
        print(f"\n  (time to first token {1000 * (first_at - start):.0f} ms)\n", file=out)
        start = time.monotonic()
        results = client.generate_many([{"prompt": p, "max_tokens": 48} for p in DEMO_PROMPTS[1:]])
        elapsed = time.monotonic() - start
    tokens = sum(len(r.token_ids) for r in results)
    print(f"{len(results)} concurrent requests, {tokens} tokens in {elapsed:.1f}s "
          f"({tokens / elapsed:.1f} tokens/s)", file=out)
    stages = ("queue", "prefill", "transfer", "staging", "admission", "decode")
    print("  " + " ".join(f"{s:>9}" for s in stages) + "   prompt", file=out)
    for prompt, r in zip(DEMO_PROMPTS[1:], results):
        row = " ".join(f"{1000 * r.trace.stage_seconds.get(s, 0.0):7.0f}ms" for s in stages)
        print(f"  {row}   {prompt[:40]} -> {r.text[:50]!r}", file=out)
    if http_url:
        run_http_demo(http_url, model, out)


def run_http_demo(http_url: str, model: str, out=sys.stdout) -> None:
    """One chat completion through the OpenAI-compatible API, as `curl` or the openai package sends it."""
    import json
    import urllib.request

    from baton.router.openai_api.protocol import served_names

    body = {"model": served_names(model, "")[0], "max_tokens": 48,
            "messages": [{"role": "user", "content": DEMO_PROMPTS[3]}]}
    print(f"\nPOST {http_url}/chat/completions {json.dumps(body)}", file=out)
    request = urllib.request.Request(f"{http_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())
    print(f"  -> {answer['choices'][0]['message']['content']!r} ({answer['usage']['completion_tokens']} tokens, "
          f"finish_reason {answer['choices'][0]['finish_reason']})", file=out)


def model_env(args) -> dict[str, str]:
    """The environment that makes every worker of a local cluster load the model as the command's
    flags say (--quantization, --quantized-inputs)."""
    return {f"BATON_MODEL_{key.upper()}": str(value) for key in ("quantization", "quantized_inputs")
            if (value := getattr(args, key, None)) is not None}


def tp_args(args, role: str) -> tuple[str, ...]:
    """A role's workers' tensor parallelism: --prefill-tp / --decode-tp, else --tp."""
    size = getattr(args, f"{role}_tp", None) or getattr(args, "tp", 1) or 1
    return ("--tensor-parallel-size", str(size)) if size > 1 else ()


def run_up(args) -> int:
    planner = planner_settings(args) if getattr(args, "planner", False) else None  # bad values: before anything starts
    cluster = LocalCluster(port=args.port, prefill=args.prefill, decode=args.decode, model=args.model,
                           max_rows=args.max_rows, share_cores=True, http_port=args.http_port,
                           dynamic=planner is not None, log_level=args.log_level, start_lines=True,
                           extra_env=model_env(args), prefill_args=tp_args(args, "prefill"),
                           decode_args=tp_args(args, "decode"))
    stop = StopSignals()  # from here on, Ctrl-C or SIGTERM ends the cluster in order
    print(f"starting {args.prefill} prefill and {args.decode} decode workers for model {args.model!r}...",
          flush=True)
    cluster.start()
    try:
        print(f"ready router={cluster.router_address} prefill={','.join(cluster.prefill_addrs)} "
              f"decode={','.join(cluster.decode_addrs)}", flush=True)
        if cluster.http_url:
            from baton.router.openai_api.protocol import served_names

            print(f"OpenAI API at {cluster.http_url} (model {served_names(args.model, '')[0]!r}), e.g.\n"
                  f"  curl {cluster.http_url}/chat/completions -H 'content-type: application/json' "
                  f"-d '{{\"model\": \"{served_names(args.model, '')[0]}\", "
                  f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hi!\"}}]}}'", flush=True)
        if args.demo:
            run_demo(cluster.router_address, http_url=cluster.http_url, model=args.model)
        elif planner is not None:
            run_planner(planner, args.dry_run, cluster, stop)
        else:
            stop.wait()
    finally:
        print("stopping...", flush=True)
        cluster.stop()
    return 0
