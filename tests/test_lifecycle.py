"""Process lifecycles an operator relies on: the router drains on SIGTERM, `baton up` takes its
workers with it even when killed, a batch cannot take every router slot, and listeners bind the
host they were given. Real processes on loopback, the tiny random model."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from baton.launch.up import LocalCluster, free_port, stop_process
from baton.client import BatonClient, BatonError

pytestmark = pytest.mark.slow

STREAM_TOKENS = 400


def test_router_sigterm_mid_stream_finishes_every_stream_exactly(tiny_reference):
    prompts = [[400 + 13 * i + j for j in range(5 + i)] for i in range(6)]
    metrics_port = free_port()
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=6,
                      router_args=("--metrics-port", str(metrics_port))) as cluster:
        router = dict(cluster.procs)[cluster.router_address]
        assert listening_address(metrics_port) == "127.0.0.1", "metrics must bind the configured host"
        with BatonClient(cluster.router_address, timeout=120) as client:
            started, results = threading.Barrier(len(prompts) + 1), {}

            def run(i: int) -> None:
                tokens = []
                for n, chunk in enumerate(client.stream(token_ids=prompts[i], max_tokens=STREAM_TOKENS,
                                                        ignore_eos=True)):
                    tokens.extend(chunk.token_ids)
                    if n == 0:
                        started.wait(timeout=60)
                results[i] = tokens

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            started.wait(timeout=60)  # every stream has its first tokens
            router.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            with pytest.raises(BatonError) as refused:  # a draining router takes no new request
                client.generate(token_ids=[5, 6, 7], max_tokens=2)
            assert refused.value.code in ("UNAVAILABLE", "CANCELLED")
            for t in threads:
                t.join(timeout=120)
        assert router.wait(timeout=30) == 0
    for i, prompt in enumerate(prompts):
        assert results.get(i) == tiny_reference.greedy(prompt, STREAM_TOKENS), f"stream {i}"


def test_a_router_killed_mid_stream_leaves_nothing_on_the_workers_and_is_served_again_at_its_address(tiny_reference):
    """A router SIGKILLed (a crashed pod) while it streams: its streams end with an error (they do
    not hang), the workers let go of their rows and KV, and the router started again at its address
    (a pod coming back) serves the same client's next requests exactly, its prefix index rebuilt
    from the workers' caches."""
    from baton.bench.chaos import DECODE_IDLE  # what a decode worker holds for a request

    prompts = [[500 + 11 * i + j for j in range(6)] for i in range(3)]
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=4) as cluster:
        with BatonClient(cluster.router_address, timeout=120) as client:
            started, ended = threading.Barrier(len(prompts) + 1), {}

            def run(i: int) -> None:
                try:
                    for n, _ in enumerate(client.stream(token_ids=prompts[i], max_tokens=STREAM_TOKENS,
                                                        ignore_eos=True)):
                        if n == 0:
                            started.wait(timeout=60)
                    ended[i] = "finished"
                except BatonError as err:
                    ended[i] = err.code

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            started.wait(timeout=60)
            cluster.restart(cluster.router_address)  # SIGKILL, then the same command on the same port
            for t in threads:
                t.join(timeout=60)
            assert ended == {i: "UNAVAILABLE" for i in range(len(prompts))}, ended
            deadline = time.monotonic() + 30
            while True:
                status = client.cluster_status()
                held = {w.address: {f: w.decode[f] for f in DECODE_IDLE if w.decode[f]}
                        for w in status.workers if w.role == "decode"}
                if not any(held.values()) and all(w.cache_synced for w in status.workers if w.role == "prefill"):
                    break
                assert time.monotonic() < deadline, f"the workers still hold {held}"
                time.sleep(0.25)
            again = client.generate(token_ids=prompts[0], max_tokens=8, ignore_eos=True)
            assert again.token_ids == tiny_reference.greedy(prompts[0], 8)


def test_a_batch_takes_no_more_router_slots_than_it_has_members():
    """A 3-request batch asking for max_concurrency 1024 leaves the router's other slots free."""
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=4,
                      router_args=("--max-inflight", "4")) as cluster:
        with BatonClient(cluster.router_address, timeout=120) as client:
            outcome = {}
            batch = threading.Thread(target=lambda: outcome.update(result=client.generate_batch(
                [{"token_ids": [300 + i, 301, 302], "max_tokens": 600, "ignore_eos": True} for i in range(3)],
                max_concurrency=1024)))
            batch.start()
            time.sleep(1.0)  # the batch is running
            interactive = client.generate(token_ids=[7, 8, 9], max_tokens=4, ignore_eos=True)
            batch.join(timeout=120)
    assert len(interactive.token_ids) == 4
    assert all(len(r.token_ids) == 600 for r in outcome["result"].results)


def test_a_client_started_with_baton_up_waits_until_served_then_sigkill_leaves_no_process(tmp_path):
    """A newcomer's script: start `baton up`, wait_ready(), generate: the first call succeeds (no
    retry loop of its own); meanwhile `baton up` showed, at the default log level, what each
    worker loaded and the sizes it chose. Then SIGKILL of `baton up` takes its processes with it."""
    port = free_port()
    with open(tmp_path / "stderr", "w") as stderr:
        up = subprocess.Popen([sys.executable, "-m", "baton.cli", "up", "--model", "tiny-random", "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    try:
        with BatonClient(f"127.0.0.1:{port}") as client:
            client.wait_ready(timeout=240)
            assert len(client.generate(token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True).token_ids) == 3
        for line in up.stdout:
            if line.startswith("ready"):
                break
        shown = [json.loads(line)["message"] for line in (tmp_path / "stderr").read_text().splitlines()
                 if line.startswith("{") and '"baton.startup"' in line]
        for start in ("loading tiny-random from", "loaded tiny-random in", "torch threads", "KV budget", "decode rows",
                      "host KV pool", "decode worker serving", "prefill worker serving", "router serving"):
            assert any(message.startswith(start) for message in shown), (start, shown)
        children = descendants(up.pid)  # the fork server and, forked from it, router, prefill and decode
        assert len(children) == 4, f"expected the fork server, router, prefill and decode processes, found {children}"
        up.kill()
        up.wait(timeout=10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(alive(pid) for pid in children):
            time.sleep(0.2)
        left = {pid: describe(pid) for pid in children if alive(pid)}
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes outlived the baton up that started them: {left}"
    finally:
        if up.poll() is None:
            stop_process(up)


def descendants(pid: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


def describe(pid: int) -> str:
    """A process's command line, state and the stack its main thread waits in, for a failure message."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return "gone"
    return f"{cmdline.strip()} (state {state}, waiting in {wchan})"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def listening_address(port: int) -> str | None:
    """The IPv4 address a TCP socket listens on at `port`, from /proc/net/tcp."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        host, _, hex_port = local.partition(":")
        if state == "0A" and int(hex_port, 16) == port:
            return ".".join(str(int(host[i:i + 2], 16)) for i in (6, 4, 2, 0))
    return None


def test_the_sdk_gives_up_on_a_frozen_router_within_seconds():
    """Keepalive pings notice a SIGSTOPped router long before the default deadline."""
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=2) as cluster:
        router = dict(cluster.procs)[cluster.router_address]
        with BatonClient(cluster.router_address, keepalive_s=1.0) as client:
            assert client._config.timeout == 600.0  # a default deadline, not forever
            stream = client.stream(token_ids=[5, 6, 7], max_tokens=1500, ignore_eos=True)
            next(iter(stream))
            router.send_signal(signal.SIGSTOP)
            started = time.monotonic()
            try:
                with pytest.raises(BatonError) as failed:
                    for _ in stream:
                        pass
                waited = time.monotonic() - started
            finally:
                router.send_signal(signal.SIGCONT)
    assert failed.value.code == "UNAVAILABLE"
    assert waited < 20, f"the client waited {waited:.1f}s on a frozen router"


def test_a_cancelled_batch_stops_its_members_on_every_worker():
    members, max_tokens = 4, 1900
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=members) as cluster:
        with BatonClient(cluster.router_address, timeout=120) as client:
            with pytest.raises(BatonError) as ended:  # the client leaves after 1.5 s
                client.generate_batch([{"token_ids": [300 + i, 301, 302], "max_tokens": max_tokens, "ignore_eos": True}
                                       for i in range(members)], max_concurrency=members, timeout=1.5)
            assert ended.value.code == "DEADLINE_EXCEEDED"
            left = time.monotonic()
            while True:
                decode = next(w.decode for w in client.cluster_status().workers if w.role == "decode")
                if decode["rows_in_use"] == 0 and decode["waiting_for_kv"] == 0 or time.monotonic() - left > 5:
                    break
                time.sleep(0.05)
    assert decode["rows_in_use"] == 0 and decode["waiting_for_kv"] == 0, decode
    assert decode["decode_tokens_forwarded"] < members * max_tokens / 2, "the members ran on after the cancel"


def test_the_advertised_context_is_the_one_served_and_max_tokens_is_cut_to_it(tiny_model, tiny_reference):
    """A decode worker whose KV budget buys 64 tokens of pages serves 65 tokens of context (the
    last token's KV is never stored): GetModelInfo says so, max_tokens past it is cut, and a
    prompt that leaves no room is refused naming the real limit."""
    rows, columns = 2, 64
    budget = (columns + 16) * tiny_model.kv_shape.bytes_per_token()  # 4 pages of 16 tokens and the null page
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=rows,
                      extra_env={"BATON_DECODE_KV_BUDGET_BYTES": str(budget), "BATON_DECODE_PAGE_SIZE": "16"}) as cluster:
        with BatonClient(cluster.router_address, timeout=60) as client:
            context = client.model_info().max_context
            assert context == columns + 1 < tiny_model.max_context
            prompt = [9, 10, 11, 12, 13]
            result = client.generate(token_ids=prompt, max_tokens=10_000, ignore_eos=True)
            assert result.finish_reason == "length"
            assert len(prompt) + len(result.token_ids) == context
            assert result.token_ids == tiny_reference.greedy(prompt, context - len(prompt))
            with pytest.raises(BatonError, match=f"context served is {context}"):
                client.generate(token_ids=list(range(1, context + 1)), max_tokens=1)


def test_a_signalled_server_exits_within_its_drain_and_stop_bound_even_if_a_stop_blocks():
    """wait_for_signal with the drain's limit: a stop that never returns (a handler blocked on
    something the stop cannot interrupt) holds the process no longer than the drain's limit plus
    lifeline.STOP_S; it says where the threads were and exits 0 (the work was drained)."""
    script = textwrap.dedent("""
        import os, signal, threading
        from baton import lifeline
        from baton.server import GrpcServer

        lifeline.STOP_S = 0.5
        server = GrpcServer("127.0.0.1", 0)
        server.start()
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        server.wait_for_signal(on_stop=threading.Event().wait, drain=lambda: None, drain_timeout_s=0.5)
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 30
    assert "since the signal" in done.stderr and "Thread 0x" in done.stderr


@pytest.mark.parametrize("role", ["decode", "router"])
def test_a_sigterm_taken_by_any_thread_drains_the_process(role):
    """The kernel hands a process-directed SIGTERM to any thread of the process that does not
    block it, not always the main one, and Python runs the handler only when the main thread next
    runs Python code. A main thread parked in `Event().wait()` never did: the drained decode
    worker of test_migration went on serving, never drained, armed no bound, and exited only when
    the test tore the cluster down (CI, now and then). Here the signal goes to a gRPC thread on
    purpose (kill(2) given a thread's id prefers that thread): the process drains and exits 0."""
    from baton.launch.up import wait_serving

    port = free_port()
    args = ["--prefill-workers", f"127.0.0.1:{free_port()}", "--decode-workers", f"127.0.0.1:{free_port()}"] \
        if role == "router" else []
    proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "--log-level", "info", role, "--host", "127.0.0.1",
                             "--port", str(port), "--model", "tiny-random", *args],
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_serving(f"127.0.0.1:{port}", proc, 120)
        threads = {}
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            try:  # a thread may end between the listing and the read
                threads[tid] = Path(f"/proc/{proc.pid}/task/{tid}/comm").read_text().strip()
            except FileNotFoundError:
                pass
        for other in (int(tid) for tid, name in threads.items() if int(tid) != proc.pid and name != "python"):
            try:
                os.kill(other, signal.SIGTERM)
                break
            except ProcessLookupError:  # ended meanwhile: the next one
                continue
        started = time.monotonic()
        status = proc.wait(timeout=60)
        stderr = proc.stderr.read()
    finally:
        stop_process(proc)
    print(f"\n{role}: SIGTERM to thread {threads[str(other)]!r}; exited {time.monotonic() - started:.1f}s later")
    assert status == 0, stderr[-2000:]
    assert '"draining"' in stderr


def test_a_signalled_server_whose_threads_cannot_run_still_exits_within_its_bound():
    """The bound's last resort needs no Python thread: a drain stuck in native code with the GIL
    held (a C call made through PyDLL keeps it) leaves the Python timer no way to run, and
    faulthandler's own thread prints every thread's stack and exits (status 1), NATIVE_GRACE_S
    after the drain's limit plus STOP_S."""
    script = textwrap.dedent("""
        import ctypes, os, signal, threading
        from baton import lifeline
        from baton.server import GrpcServer

        lifeline.STOP_S = lifeline.NATIVE_GRACE_S = 0.5
        server = GrpcServer("127.0.0.1", 0)
        server.start()
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        stuck = lambda: ctypes.PyDLL(None).sleep(120)  # libc's sleep, holding the GIL all along
        server.wait_for_signal(drain=stuck, drain_timeout_s=0.5)
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    elapsed = time.monotonic() - started
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert elapsed < 60, elapsed
    assert "Timeout" in done.stderr and 'File "<string>", line 10' in done.stderr  # where the drain was stuck


def test_a_stopped_server_process_exits_even_with_a_thread_still_blocked():
    """bound_exit: interpreter exit would join a blocked non-daemon thread forever; it gives up
    after its bound, says where the threads were, and exits with the status it was given."""
    script = textwrap.dedent("""
        import threading
        from baton.lifeline import bound_exit

        threading.Thread(target=threading.Event().wait, name="stuck-handler").start()  # never set
        bound_exit(0, seconds=0.5)
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 30
    assert "threads still running" in done.stderr and "Thread 0x" in done.stderr  # where each thread was



def test_a_channel_to_a_peer_restarted_at_its_address_connects_at_once():
    """A worker that restarts comes back at its address (a container restart keeps its pod IP). A
    channel opened to it then connects on its first call, though another channel of this process
    was refused there a moment ago: gRPC shares connections between channels by default, and a
    refused one fails every call at once until its reconnect backoff ends."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from baton.server import channel

    def serve(port: int) -> tuple[grpc.Server, int]:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        port = server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        return server, port

    def check(ch: grpc.Channel) -> str:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return "served"
        except grpc.RpcError as err:
            return err.code().name

    server, port = serve(0)
    server.stop(None)
    with channel(f"127.0.0.1:{port}") as refused:
        assert check(refused) == "UNAVAILABLE"
        server, _ = serve(port)
        try:
            with channel(f"127.0.0.1:{port}") as fresh:
                assert check(fresh) == "served"
        finally:
            server.stop(None)
