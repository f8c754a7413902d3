"""A process Baton started dies with the process that started it.

Standard library only: the command line calls `die_with_parent` first thing, before it knows
whether the servers' packages are installed (the SDK-only install runs `baton generate` too).
"""
from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time

PARENT_ENV = "BATON_PARENT_PID"  # set for the processes Baton starts: they exit when that process dies


ORPHAN_EXIT_S = 20.0  # a process whose parent died is gone this long after, drained or not


def die_with_parent() -> None:
    """In a process Baton started (PARENT_ENV set): have the kernel send SIGTERM (a drain) when its
    parent dies, even by SIGKILL, so no worker outlives `baton up` holding its port. Linux only.
    A watchdog backs it: an orphan still alive ORPHAN_EXIT_S later prints where its threads are
    and exits.

    The kernel ties this to the parent *thread* that started the process: Baton starts its
    processes from the main thread."""
    expected = os.environ.pop(PARENT_ENV, "")
    if not expected or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    threading.Thread(target=_exit_when_orphaned, args=(int(expected),), name="orphan-watchdog", daemon=True).start()
    if os.getppid() != int(expected):  # the parent died before the line above took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _exit_when_orphaned(parent: int, poll_s: float = 0.5) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    time.sleep(ORPHAN_EXIT_S)
    _exit_showing_threads(f"parent {parent} died {ORPHAN_EXIT_S:.0f}s ago and this process has not finished "
                          "draining", 1)


def _exit_showing_threads(why: str, status: int) -> None:
    """Give up on a process that should have ended: say why and where its threads are, then exit."""
    import faulthandler

    print(f"baton: {why}; exiting. Its threads were at:", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(all_threads=True)
    os._exit(status)


EXIT_JOIN_S = 15.0  # after an orderly stop, how long interpreter exit may wait for stray threads
STOP_S = 40.0  # after a drain's own limit, how long the stops may take (gRPC's grace, the loops' joins)
NATIVE_GRACE_S = 5.0  # how much later than a bound the native watchdog ends a process no Python thread can run in
SIGNAL_POLL_S = 0.5  # a main thread waiting for a signal runs Python code at least this often (StopSignals)


class StopSignals:
    """From construction on (in the main thread), records SIGTERM and SIGINT; `wait()` blocks until
    one has come.

    Python runs a signal handler in the main thread only, when that thread next runs Python code.
    The kernel hands a process-directed signal to any of its threads that does not block it, not
    always the main one; then the main thread is not interrupted, and one blocked in a lock wait
    without a timeout (`threading.Event().wait()`) never runs the handler (CPython issue 85300):
    a SIGTERM'd worker went on serving, never drained, and armed no bound. So the main thread
    waits on a socket that Python's C-level handler writes to from whichever thread took the
    signal (signal.set_wakeup_fd, as asyncio does), and wakes at once; every `poll_s` as well,
    should a wakeup byte be lost. The handler only records the signal: one that took a lock
    (Event.set) could deadlock against the main thread interrupted while holding it."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.received: list[int] = []
        self._wakeup, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        for sig in signals:
            signal.signal(sig, lambda signum, _frame: self.received.append(signum))

    def wait(self, poll_s: float = SIGNAL_POLL_S, timeout: float | None = None) -> int | None:
        """The first signal's number, once one has come; None if `timeout` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.received:
            left = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
            if left <= 0:
                return None
            if select.select([self._wakeup], [], [], left)[0]:
                self._wakeup.recv(64)  # the handler itself runs as this thread goes on in Python
        return self.received[0]


def wait_for_stop_signal() -> int:
    """Block the main thread until SIGTERM or SIGINT; return its number (see StopSignals)."""
    return StopSignals().wait()


_native_deadline = float("inf")  # when faulthandler's watchdog fires (it keeps one at a time)


def bound_exit(status: int = 0, seconds: float = EXIT_JOIN_S,
               why: str = "stopped, but exit has waited {seconds:.0f}s for threads still running") -> None:
    """Call when a server has stopped in order and is about to return from main: interpreter
    exit then joins every non-daemon thread, without limit, and a thread still blocked in a
    call nothing interrupts (a socket, another pool's job) would keep the process and its port
    alive. Past `seconds`, print where the threads are and exit with `status`. Also armed when a
    stop begins (`why` says so), which bounds the drain and the stops themselves.

    Two watchdogs: a Python timer says why and exits with `status`; should no Python thread be
    able to run then (one holding the GIL in native code), faulthandler's own C thread prints
    every thread's stack and exits with status 1, NATIVE_GRACE_S later. A later, longer bound
    never postpones an earlier one."""
    global _native_deadline
    timer = threading.Timer(seconds, _exit_showing_threads, (why.format(seconds=seconds), status))
    timer.daemon = True  # it runs while exit joins the others, and dies with a clean exit
    timer.start()
    import faulthandler

    deadline = time.monotonic() + seconds + NATIVE_GRACE_S
    if deadline < _native_deadline:
        _native_deadline = deadline
        faulthandler.dump_traceback_later(seconds + NATIVE_GRACE_S, exit=True)
