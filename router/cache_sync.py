"""Keeps the prefix index equal to what each prefill worker's cache holds.

One thread per prefill worker follows its WatchCache stream: a snapshot replaces what the index
said of the worker, then every numbered change is applied in order as the worker makes it, so
the index learns of new blocks within milliseconds, whatever becomes of the request that stored
them. A gap in the numbers, a new epoch (the worker restarted), a broken stream or a failed
write to the index (Redis down) makes the thread ask again for a snapshot. So does a lost index:
a Redis that restarted empty shows a new generation, and every follower resynchronises. A worker
that discovery drops loses its entries at once; the index's TTL, refreshed by a snapshot every
`refresh_s`, backstops everything else.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from baton.v1 import workers_pb2
from baton.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

SNAPSHOT_CHUNK = 4096  # blocks per index write while applying a snapshot
RETRY_S = (0.2, 1.0)  # first and longest wait before following a worker again


class CacheSync:
    def __init__(self, index: PrefixIndex, refresh_s: float | None = 300.0, check_s: float = 1.0,
                 on_event: Callable[[str, str], None] = lambda address, kind: None):
        self.index = index
        self.refresh_s = refresh_s
        self.check_s = check_s
        self.on_event = on_event  # (worker, "change" | "snapshot" | "gap" | "error" | "lost"), for metrics
        # Told of a worker whose cache we no longer see (its stream broke or it left): the router
        # drops what else it assumed there (the dispatcher's pending prefixes).
        self.on_lost: Callable[[str], None] = lambda address: None
        self._follows: dict[str, _Follow] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._generation = None
        self._checker = threading.Thread(target=self._check_index, name="index-check", daemon=True)

    def start(self) -> "CacheSync":
        self._checker.start()
        return self

    def follow(self, address: str, stub) -> None:
        """Follow a prefill worker that joined (`stub` is its PrefillWorkerStub)."""
        with self._lock:
            if address in self._follows or self._stop.is_set():
                return
            self._follows[address] = _Follow(self, address, stub).start()

    def forget(self, address: str) -> None:
        """A prefill worker left: stop following it and drop what the index said it holds."""
        with self._lock:
            follow = self._follows.pop(address, None)
        if follow is not None:
            follow.stop()
        self.lost(address)

    def lost(self, address: str) -> None:
        """Claim nothing for `address` until a snapshot says again what it holds: it left, or its
        stream broke (it died, or restarted with an empty cache)."""
        self.on_event(address, "lost")
        try:
            self.on_lost(address)
            self.index.remove_worker(address)
        except Exception:  # the index (e.g. Redis) failing must not stop discovery
            log.exception("forgetting the prefix index entries of %s failed", address)

    def resync(self) -> None:
        """Every follower starts again from a snapshot."""
        with self._lock:
            follows = list(self._follows.values())
        for follow in follows:
            follow.restart()

    def synced(self, address: str) -> bool:
        """Whether the index holds a snapshot of `address` and every change since."""
        with self._lock:
            follow = self._follows.get(address)
        return follow is not None and follow.seq is not None

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            follows, self._follows = list(self._follows.values()), {}
        for follow in follows:
            follow.stop()
        if self._checker.is_alive():
            self._checker.join(timeout=5)

    def _check_index(self) -> None:
        while not self._stop.wait(self.check_s):
            try:
                generation = self.index.generation()
            except Exception as exc:  # Redis unreachable: the followers notice on their next write
                log.debug("prefix index generation unreadable: %s", exc)
                continue
            if self._generation is not None and generation != self._generation:
                log.warning("the prefix index was lost (a new generation: Redis restarted?); resynchronising "
                            "from every prefill worker")
                self.resync()
            self._generation = generation
            if self.refresh_s is not None:  # a fresh snapshot re-touches every entry the TTL would expire
                with self._lock:
                    stale = [f for f in self._follows.values()
                             if f.seq is not None and time.monotonic() - f.snapshot_at > self.refresh_s]
                for follow in stale:
                    follow.restart()


class _Follow:
    """One prefill worker's stream, applied to the index."""

    def __init__(self, sync: CacheSync, address: str, stub):
        self.sync = sync
        self.address = address
        self.stub = stub
        self.epoch = ""
        self.seq: int | None = None  # the last change applied; None: a snapshot is needed
        self.snapshot_at = time.monotonic()
        self._call = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"cache-sync-{address}", daemon=True)

    def start(self) -> "_Follow":
        self._thread.start()
        return self

    def restart(self) -> None:
        with self._lock:
            self.seq = None
            if self._call is not None:
                self._call.cancel()

    def stop(self) -> None:
        self._stop.set()
        self.restart()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        wait = RETRY_S[0]
        while not self._stop.is_set():
            try:
                if self._stream():
                    wait = RETRY_S[0]
                    continue  # a planned restart: again at once
                self.sync.lost(self.address)  # the worker ended the stream: it is stopping
            except grpc.RpcError as err:  # the worker went away, or restart() cut the stream
                if self._stop.is_set():
                    return
                if err.code() != grpc.StatusCode.CANCELLED:
                    log.debug("following the prefix cache of %s broke: %s", self.address, err.details())
                    self.sync.lost(self.address)
            except ValueError as exc:
                if "closed" in str(exc).lower():  # the channel was closed: its pool stopped, so do we
                    return
                log.exception("applying the prefix cache changes of %s failed", self.address)
                self.sync.on_event(self.address, "error")
            except Exception:  # the index failed (Redis down): resync once it is back
                log.exception("applying the prefix cache changes of %s failed", self.address)
                self.sync.on_event(self.address, "error")
            with self._lock:
                self.seq = None
            if self._stop.wait(wait):
                return
            wait = min(wait * 2, RETRY_S[1])

    def _stream(self) -> bool:
        """Follow until the stream breaks (raises), ends (False: the worker stops) or must start
        again from a snapshot (True)."""
        with self._lock:
            if self._stop.is_set():
                return False
            request = workers_pb2.WatchCacheRequest(epoch=self.epoch if self.seq is not None else "",
                                                    after_seq=self.seq or 0)
            self._call = call = self.stub.WatchCache(request)
        index, address = self.sync.index, self.address
        for event in call:
            with self._lock:
                if self._stop.is_set() or (self.seq is None and self.epoch and not event.snapshot):
                    call.cancel()  # stop() or restart() meanwhile: a snapshot next, or nothing
                    return not self._stop.is_set()
            if event.snapshot:
                if event.epoch != self.epoch:  # a new process: it computes nothing we sent the old one
                    self.sync.on_lost(address)
                index.remove_worker(address)
                stored = list(event.stored)
                for i in range(0, len(stored), SNAPSHOT_CHUNK):
                    index.apply_event(address, stored=stored[i:i + SNAPSHOT_CHUNK])
                self.snapshot_at = time.monotonic()
                if self.epoch and event.epoch != self.epoch:
                    log.info("prefill worker %s restarted (epoch %s -> %s)", address, self.epoch, event.epoch)
                self.sync.on_event(address, "snapshot")
            elif event.epoch != self.epoch or self.seq is None or event.seq != self.seq + 1:
                log.warning("prefix cache changes of %s arrived out of order (epoch %s seq %d after %s seq %s); "
                            "resynchronising", address, event.epoch, event.seq, self.epoch, self.seq)
                self.sync.on_event(address, "gap")
                with self._lock:
                    self.seq = None
                call.cancel()
                return True
            else:
                index.apply_event(address, stored=list(event.stored), evicted=list(event.evicted))
                self.sync.on_event(address, "change")
            with self._lock:
                if self._stop.is_set() or (self.seq is None and not event.snapshot):
                    call.cancel()  # restart() asked for a snapshot meanwhile
                    return not self._stop.is_set()
                self.epoch, self.seq = event.epoch, event.seq
        return False  # the worker stopped: follow it again after a wait
