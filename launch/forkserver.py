"""Baton's local processes forked from one that has already imported what they all import.

A worker spends most of its start importing torch, transformers' tokenizers and gRPC (about 3 of
its 4.5 CPU-seconds on a 2-core machine), the same modules every time. A local cluster (`baton
up`, the planner's `LocalScaler`, a restart, a test or benchmark that starts many clusters)
instead asks a fork server, started once per process and importing them once, to fork each of
its processes: the child runs `baton.cli` with its own arguments, environment, standard streams
and session, as `python -m baton.cli` would, and the server tells its parent how it exited.

Forking after those imports is safe while nothing in the server has started a thread pool,
opened a channel or touched a GPU: the server imports modules and forks, nothing else (torch's
CPU threads, gRPC's core and CUDA all start on first use, in the child). Python's
multiprocessing forkserver does the same, but re-runs the parent's main script in every child.

Wire (a Unix socket pair): the parent sends a JSON request {"argv", "env"} with three file
descriptors (the child's stdout, stderr and its status socket); the server writes the child's
pid, then, once it has exited, its status as subprocess.Popen reports it (-N: killed by signal
N), to that status socket. The server exits when its parent's end of the pair closes; its
children, told that the server is their parent (`baton.lifeline`), then drain and exit.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading

# What every Baton process imports before it does anything: imported once, in the server.
PRELOAD = ("torch", "transformers", "baton.cli", "baton.engine.model", "baton.decode_worker.service",
           "baton.prefill_worker.service", "baton.router.service")
FORKSERVER_ENV = "BATON_FORKSERVER"  # "0": LocalCluster starts each process as a fresh interpreter instead
_STATUS = struct.Struct("<i")
_MAX_REQUEST = 1 << 20


class ForkServer:
    """The server, started on first use; one per process (`forkserver()`)."""

    def __init__(self):
        parent, child = socket.socketpair()
        self._socket = parent
        self._lock = threading.Lock()
        self._proc = subprocess.Popen([sys.executable, "-m", "baton.launch.forkserver", str(child.fileno())],
                                      pass_fds=[child.fileno()], stdin=subprocess.DEVNULL)
        child.close()

    def start(self, argv: list[str], env: dict[str, str], netns: str = "") -> "ForkedProcess":
        """Fork `baton.cli argv` with `env` (in network namespace `netns`, as `ip netns exec` runs it)."""
        mine, theirs = socket.socketpair()
        try:
            with self._lock:
                if self._proc.poll() is not None:
                    raise OSError(f"the fork server exited with status {self._proc.returncode}")
                # this process's own stdout and stderr (what a Popen child inherits), whatever sys.stdout is now
                socket.send_fds(self._socket, [json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(), "netns": netns}).encode()],
                                [1, 2, theirs.fileno()])
        finally:
            theirs.close()
        return ForkedProcess(mine, argv)


class ForkedProcess:
    """A `baton.cli` process forked by the server; what LocalCluster uses of subprocess.Popen:
    pid, returncode, poll, wait, send_signal, terminate, kill."""

    def __init__(self, status: socket.socket, argv: list[str]):
        self._status = status
        self._lock = threading.Lock()  # one reader of the status socket at a time
        self.args = ["baton", *argv]
        self.returncode: int | None = None
        pid = self._read(None)
        if pid is None:
            raise OSError("the fork server did not start the process")
        self.pid = pid

    def _read(self, timeout: float | None) -> int | None:
        """The next number on the status socket; None after `timeout` or at its end."""
        if not select.select([self._status], [], [], timeout)[0]:
            return None
        data = self._status.recv(_STATUS.size, socket.MSG_WAITALL)
        return _STATUS.unpack(data)[0] if len(data) == _STATUS.size else None

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            if self.returncode is None:
                status = self._read(timeout)
                if status is None and not select.select([self._status], [], [], 0)[0]:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                self.returncode = 255 if status is None else status  # closed with no status: the server died
                self._status.close()
            return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_server: ForkServer | None = None
_server_lock = threading.Lock()


def forkserver() -> ForkServer:
    global _server
    with _server_lock:
        if _server is None or _server._proc.poll() is not None:
            _server = ForkServer()
        return _server


def _serve(control: socket.socket) -> None:
    """The server: preload, then fork a child per request until the parent goes."""
    import gc
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from baton.engine.model_files import preload_default_tokenizer

    preload_default_tokenizer()  # read once here, not in each child (files only: no threads started)
    gc.freeze()  # what the server imported stays out of the children's collections (and their copies' pages)
    waker_r, waker_w = socket.socketpair()
    waker_w.setblocking(False)
    signal.set_wakeup_fd(waker_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for baton up, which stops its processes in order
    children: dict[int, socket.socket] = {}
    while True:
        readable = select.select([control, waker_r], [], [])[0]
        if waker_r in readable:
            waker_r.recv(4096)
            _reap(children)
        if control in readable:
            try:
                message, fds, _, _ = socket.recv_fds(control, _MAX_REQUEST, 3)
            except OSError:
                message, fds = b"", []
            if not message:  # the parent is gone: so are we (our children follow, see _child)
                return
            request = json.loads(message)
            status = socket.socket(fileno=fds[2])
            pid = os.fork()
            if pid == 0:
                _child(request, fds, control, waker_r, waker_w, status, *children.values())
            os.close(fds[0])
            os.close(fds[1])
            status.sendall(_STATUS.pack(pid))
            children[pid] = status
            _reap(children)


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        reply = children.pop(pid, None)
        if reply is not None:
            try:
                reply.sendall(_STATUS.pack(code))
            except OSError:
                pass
            reply.close()


def _child(request: dict, fds: list[int], *server_sockets) -> None:
    """In the forked child: become what `python -m baton.cli argv` with `env` would be, then run
    it; its SystemExit leaves through the interpreter's own exit (threads joined, atexit run).
    server_sockets: the server's, its own status socket among them, closed through their objects
    (closing a number under one would close whatever later reused it when the object went)."""
    try:
        for s in server_sockets:
            s.close()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()  # its own session, as start_new_session: a Ctrl-C at a terminal reaches baton up alone
        if request["netns"]:  # a host of its own (launch/netns.py): its network, as `ip netns exec` gives
            _enter_netns(request["netns"])
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        os.close(fds[0])
        os.close(fds[1])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        from baton.lifeline import PARENT_ENV

        os.environ[PARENT_ENV] = str(os.getppid())  # it dies with the server, which dies with its parent
        import random

        import torch

        random.seed()
        torch.seed()  # else every child would draw the server's random numbers
        sys.argv = ["baton", *request["argv"]]
    except BaseException:  # not a baton process yet: say why and go
        import traceback

        traceback.print_exc()
        os._exit(1)
    # The command line is run as `python -m baton.cli` runs it (a program above this floor, not an
    # import of it); its SystemExit ends the process.
    import runpy

    runpy.run_module("baton.cli", run_name="__main__", alter_sys=True)


def _enter_netns(name: str) -> None:
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python 3.12
            os.setns(fd, os.CLONE_NEWNET)
        else:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
