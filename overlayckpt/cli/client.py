"""The CLI's side of the control channel, and the offline path for unmounted stores."""
from __future__ import annotations

import errno
import json
import os
import select
import time

from overlayckpt.errors import PartlyDone, UserError

TYPE_CHECKING = False  # (not typing's: typing costs every CLI start a few ms)
if TYPE_CHECKING:
    from typing import TypeVar

    from overlayckpt.messages import Request, StatusReply
    R = TypeVar("R")

DAEMON_EXIT_WAIT = 10.0  # seconds a daemon whose mount is gone may take to close its store


def send(mountpoint: str, cmd: Request[R]) -> R:
    """Write one command to the daemon's ctl file and return its JSON reply."""
    with Connection(mountpoint) as conn:
        return conn.call(cmd)


def status(mountpoint: str) -> StatusReply:
    """The daemon's status from status.json: a read, which no command running holds up."""
    path = os.path.join(mountpoint, ".overlayckpt", "status.json")
    try:
        with open(path, "rb") as f:
            reply: StatusReply = json.loads(f.read())
            return reply
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise UserError(f"{mountpoint}: the daemon is gone (stale mount); run 'overlayckpt "
                            "mount' again to recover it") from None
        raise UserError(f"cannot reach the daemon at {mountpoint}: {e.strerror}") from None


class Connection:
    """An open ctl handle: any number of commands, each one write and (usually) one read.
    For a caller that sends many commands; the CLI sends one per process."""

    def __init__(self, mountpoint: str) -> None:
        self.mountpoint = mountpoint
        try:
            self.fd = os.open(os.path.join(mountpoint, ".overlayckpt", "ctl"), os.O_RDWR)
        except OSError as e:
            if e.errno == errno.ENOTCONN:
                raise UserError(f"{mountpoint}: the daemon is gone (stale mount); run 'overlayckpt "
                                "mount' again to recover it") from None
            raise UserError(f"cannot reach the daemon at {mountpoint}: {e.strerror}") from None
        self.offset = 0  # replies are a stream on the handle, like a socket's

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def call(self, cmd: Request[R]) -> R:
        failed: OSError | None = None
        try:
            os.write(self.fd, (json.dumps(cmd.to_json()) + "\n").encode())
        except OSError as e:  # a failed command: its reply says why (ENOSPC, EIO: the store)
            failed = e
        chunks: list[bytes] = []
        while True:  # the reply is one line: stop at its end, without one more read
            # small first: the kernel pins every page of a direct-io read buffer, and
            # faulting in a fresh 1 MiB costs more than the command itself
            try:
                chunk = os.pread(self.fd, 1 << 20 if chunks else 16 << 10, self.offset)
            except OSError as e:
                raise UserError(f"daemon at {self.mountpoint} failed: "
                                f"{(failed or e).strerror}") from None
            if not chunk:
                break
            chunks.append(chunk)
            self.offset += len(chunk)
            if chunk.endswith(b"\n"):
                break
        lines = b"".join(chunks).decode().strip().splitlines()
        if not lines:
            if failed is not None and failed.errno != errno.EINVAL:
                raise UserError(f"daemon at {self.mountpoint} failed: {failed.strerror}")
            raise UserError(f"daemon at {self.mountpoint} gave no reply")
        reply = json.loads(lines[-1])
        if not reply.get("ok"):
            details = {k: v for k, v in reply.items() if k not in ("ok", "error")}
            if details:  # a command that failed part way: what it changed, for --json
                raise PartlyDone(reply.get("error", "failed"), details)
            raise UserError(reply.get("error", "failed"))
        reply.pop("ok", None)
        answer: R = reply  # (the daemon answers cmd with cmd's reply: messages.py)
        return answer


def offline(store_dir: str, cmd: Request[R]) -> R:
    """Run one command on an unmounted session by opening its store here."""
    from overlayckpt.service.session import Session
    session = Session.open(store_dir)
    try:

        import trio  # (only offline: talking to a daemon needs neither trio nor lmdb)
        return trio.run(session.command, cmd)
    finally:
        session.close()


def served_at(store_dir: str) -> str | None:
    """Where a live daemon serves the session in store_dir, if one does."""
    from overlayckpt.store.info import read_info  # (not on the daemon's path: it is heavier)
    info = read_info(store_dir)
    if info.get("pid") and pid_alive(info["pid"]) and info.get("mountpoint"):
        return str(info["mountpoint"])
    return None


def call_store(store_dir: str, cmd: Request[R]) -> R:
    """One command on the session in store_dir: through its daemon if one serves it."""
    mountpoint = served_at(store_dir)
    if mountpoint is None:
        return offline(store_dir, cmd)
    try:
        conn = Connection(mountpoint)
    except UserError:
        # unmounted a moment ago, its daemon still closing the store: once it has, open it here
        deadline = time.monotonic() + DAEMON_EXIT_WAIT
        while served_at(store_dir) is not None:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
        return offline(store_dir, cmd)
    with conn:
        return conn.call(cmd)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait, at most timeout seconds, until process pid has exited; whether it has. Its
    pidfd says so the moment it does (an unmount waits for the daemon to close the store),
    where looking every 20 ms cost each unmount 10 ms on average."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:  # (no pidfd here: look)
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        return not pid_alive(pid)
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def is_stale(path: str) -> bool:
    """A mount whose daemon is gone. The root's attributes may still be cached in the
    kernel, so look at status.json too (its attributes are never cached)."""
    for p in (path, os.path.join(path, ".overlayckpt", "status.json")):
        try:
            os.stat(p)
        except OSError as e:
            if e.errno == errno.ENOTCONN:
                return True
    return False
