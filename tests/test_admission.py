"""The router's admission of requests into the cluster (router/admission.py): plain Python, and
one real cluster whose decode worker never holds more requests than its rows plus the queue."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from baton.router.admission import AdmissionCancelled, AdmissionTimeout, DecodeAdmission


@dataclass
class View:
    capacity: int
    healthy: bool = True


def test_requests_enter_while_rows_and_the_queue_have_room_then_wait():
    gate = DecodeAdmission(queue_per_worker=1, poll_s=0.01)
    views = [View(2), View(3), View(8, healthy=False)]  # (2 + 1) + (3 + 1); the unhealthy one counts nothing
    assert gate.limit(views) == 7
    for _ in range(7):
        gate.enter(lambda: views)
    with pytest.raises(AdmissionTimeout):
        gate.enter(lambda: views, deadline=time.monotonic() + 0.05)
    assert gate.admitted == 7 and gate.waiting == 0
    gate.leave()
    gate.enter(lambda: views, deadline=time.monotonic() + 1)  # a finished request made room
    assert gate.admitted == 7


def test_no_bound_and_no_decode_worker_let_requests_through():
    assert DecodeAdmission(-1).limit([View(1)]) is None
    gate = DecodeAdmission(0)
    assert gate.limit([]) is None and gate.limit([View(4, healthy=False)]) is None
    for _ in range(50):
        gate.enter(lambda: [])
    with pytest.raises(ValueError, match="queue_per_worker"):
        DecodeAdmission(-2)


def test_waiters_enter_by_priority_then_arrival_and_a_cancel_leaves_the_line():
    gate = DecodeAdmission(queue_per_worker=0, poll_s=0.01)
    views = [View(1)]
    gate.enter(lambda: views)  # the one row is taken
    order, cancel = [], threading.Event()

    def wait(name: str, priority: int, cancelled=None):
        try:
            gate.enter(lambda: views, priority=priority, cancelled=cancelled)
            order.append(name)
        except AdmissionCancelled:
            order.append(f"{name} cancelled")

    threads = []
    for name, priority, cancelled in (("low", 0, None), ("gone", 5, cancel), ("high", 5, None), ("low2", 0, None)):
        threads.append(threading.Thread(target=wait, args=(name, priority, cancelled)))
        threads[-1].start()
        time.sleep(0.05)  # arrival order
    assert gate.waiting == 4
    cancel.set()
    time.sleep(0.1)
    assert order == ["gone cancelled"] and gate.waiting == 3
    for expected in ("high", "low", "low2"):
        gate.leave()
        deadline = time.monotonic() + 2
        while len(order) < 2 + ["high", "low", "low2"].index(expected) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert order[-1] == expected
    for t in threads:
        t.join(2)
    assert gate.admitted == 1 and gate.waiting == 0


@pytest.mark.slow
def test_a_cluster_holds_requests_before_prefill_while_the_decode_rows_are_taken(tiny_model, tiny_reference):
    """One decode row and no queue: the decode worker never holds more than one request (none
    waits there with its first token), and every request still ends with generate's tokens."""
    from baton.client import BatonClient
    from baton.launch.up import LocalCluster

    prompts = [[20 + 7 * i + j for j in range(5 + i)] for i in range(4)]
    with LocalCluster(prefill=1, decode=1, model="tiny-random", max_rows=1,
                      extra_env={"BATON_ROUTER_DECODE_QUEUE_PER_WORKER": "0"}) as cluster:
        with BatonClient(cluster.router_address, timeout=120) as client:
            results, held = {}, []
            done = threading.Event()

            def watch():
                while not done.is_set():
                    decode = next(w.decode for w in client.cluster_status().workers if w.role == "decode")
                    held.append(decode["rows_in_use"] + decode["staged"] + decode["waiting_for_kv"])
                    time.sleep(0.02)

            watcher = threading.Thread(target=watch)
            watcher.start()
            try:
                def one(i):
                    results[i] = client.generate(token_ids=prompts[i], max_tokens=120, ignore_eos=True, temperature=0)

                workers = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
                for w in workers:
                    w.start()
                for w in workers:
                    w.join(120)
            finally:
                done.set()
                watcher.join(10)
    assert max(held) == 1 and len(held) > 5, held
    for i, prompt in enumerate(prompts):
        assert results[i].token_ids == tiny_reference.greedy(prompt, 120)
