"""The reader: the read-only work of commands, in processes of their own beside the daemon.

A command's reading (log's file lists and line counts, a diff, show, a whole-store
check, a restore's file list: registry.READINGS) is Python on the CPU. In a thread
of the daemon it holds the GIL the request loop needs, and when the machine has
fewer cores than busy processes it takes the cores the requests need. A reader is a separate process at
a lower priority (NICE): the kernel runs the mount's requests first, and nothing is
shared with them but the store's map, which LMDB serves to readers in other
processes as it is at each read's start. A reader opens the store read-only and
the repo through the daemon's own descriptor of it (a mount in place hides its
path), and exits when its pipe closes: when the daemon closes it, or exits however.
(Not PR_SET_PDEATHSIG: trio starts processes from worker threads, and that signal
comes when the starting thread ends.)

The daemon keeps one reader ready and starts more while several commands read at
once. A command whose wait is cancelled (SIGTERM, unmount) kills its reader: a
reader holds nothing that a kill could leave half done. Messages are pickles,
each after its length: (name, command) in; ("ok", result), ("user", message) or
("error", traceback) out.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import traceback
from collections.abc import Mapping
from typing import Any

import trio

from overlayckpt.errors import ReaderFailed, UserError
from overlayckpt.messages import Request

log = logging.getLogger(__name__)

NICE = 10  # the mount's requests come first: a busy reader takes a tenth of a contested core
KEEP = 1  # readers kept ready between commands
_LEN = struct.Struct("<I")


class _Proc:
    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.buf = b""

    async def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        assert self.proc.stdin is not None
        try:
            await self.proc.stdin.send_all(_LEN.pack(len(data)) + data)
        except trio.BrokenResourceError:
            raise ReaderFailed(f"the store's reader exited ({self.proc.poll()})") from None

    async def receive(self) -> Any:
        assert self.proc.stdout is not None
        need = _LEN.size
        while True:
            if len(self.buf) >= need:
                if need == _LEN.size:
                    need += _LEN.unpack_from(self.buf)[0]
                    continue
                obj = pickle.loads(self.buf[_LEN.size:need])
                self.buf = self.buf[need:]
                return obj
            chunk = await self.proc.stdout.receive_some(1 << 20)
            if not chunk:
                raise ReaderFailed(f"the store's reader exited ({self.proc.poll()})")
            self.buf += chunk

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


class Readers:
    """The daemon's readers of one session (store_dir, the repo's path and descriptor)."""

    def __init__(self, store_dir: str, repo: str, repo_fd: int) -> None:
        self.store_dir, self.repo, self.repo_fd = store_dir, repo, repo_fd
        self._ready: list[_Proc] = []
        self._all: set[_Proc] = set()
        self.closed = False

    async def _start(self) -> _Proc:
        argv = [sys.executable, "-m", "overlayckpt.service.reader", self.store_dir, self.repo,
                str(self.repo_fd)]
        proc = _Proc(await trio.lowlevel.open_process(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(self.repo_fd,), cwd="/"))
        self._all.add(proc)
        return proc

    async def warm(self) -> None:
        """Have a reader ready for the first command."""
        if not self._ready and not self.closed:
            self._ready.append(await self._start())

    async def call(self, name: str, cmd: Request[Any]) -> Mapping[str, object]:
        """The reading `name` of cmd, in a reader; a user's mistake raises UserError."""
        if self.closed:
            raise UserError("the daemon is stopping: the command was not run")
        proc = self._ready.pop() if self._ready else await self._start()
        try:
            await proc.send((name, cmd))
            kind, value = await proc.receive()
        except BaseException:
            self._drop(proc)  # (cancelled mid-way, or dead: never reused)
            raise
        if len(self._ready) < KEEP:
            self._ready.append(proc)
        else:
            self._drop(proc)
        if kind == "ok":
            return value
        if kind == "user":
            raise UserError(value)
        raise ReaderFailed(value)

    def reset(self) -> None:
        """Readers cache what they read of the repo: after apply changed it, start anew."""
        for proc in self._ready:
            self._drop(proc)
        self._ready.clear()

    def _drop(self, proc: _Proc) -> None:
        proc.kill()
        trio.lowlevel.spawn_system_task(proc.proc.wait)  # (reaped, never a zombie)
        self._all.discard(proc)
        for stream in (proc.proc.stdin, proc.proc.stdout):
            stream.close()  # type: ignore[union-attr]  # both are FdStreams: a plain close

    def close(self) -> None:
        """Kill every reader (outside trio too: by pid, as the daemon exits)."""
        self.closed = True
        for proc in list(self._all):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.proc.pid, signal.SIGKILL)
        self._all.clear()
        self._ready.clear()


# -- the reader process -----------------------------------------------------------------


def _read_exact(f: Any, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = f.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _serve(store_dir: str, repo: str, repo_fd: int) -> None:
    from overlayckpt.service.registry import READINGS
    from overlayckpt.service.session import Session
    session = Session.open_reader(store_dir, repo, repo_fd)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = _read_exact(inp, _LEN.size)
        if head is None:
            return
        body = _read_exact(inp, _LEN.unpack(head)[0])
        if body is None:
            return
        name, cmd = pickle.loads(body)
        try:
            reply: tuple[str, Any] = ("ok", READINGS[name](session, session.store, cmd))
        except UserError as e:
            reply = ("user", str(e))
        except Exception:
            reply = ("error", traceback.format_exc())
        data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        out.write(_LEN.pack(len(data)) + data)
        out.flush()


def main() -> None:
    os.setpriority(os.PRIO_PROCESS, 0, NICE)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    store_dir, repo, fd = sys.argv[1], sys.argv[2], int(sys.argv[3])
    logging.basicConfig(level=logging.WARNING, format="reader %(process)d: %(message)s")
    _serve(store_dir, repo, fd)


if __name__ == "__main__":
    main()
