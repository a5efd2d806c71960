"""The hidden control directory `.overlayckpt` at the mount root.

readdir of the root never lists it, lookup finds it. Its entries:
  ctl                 write one JSON command per line, read the replies back
                      from the same open handle; a failed command fails the
                      write (EINVAL; ENOSPC or EIO when the store could not
                      take it) and the reply says why
  status.json         read-only status
  conversation.jsonl  append-only conversation sidecar
  checkpoints/ID/     read-only view of the tree at checkpoint ID (names are
                      symlinks to ids)
Served with direct_io: every read asks the daemon. The kernel may keep the
names (they never change) and the attributes of the directory and of ctl (its
mode and size never change), which spares a checkpoint request two lookups and
two permission checks; status.json keeps no cached attributes, so a stat of it
always reaches the daemon (client.is_stale relies on that).

Stopping: `interrupt` cuts short every command running (each one's client reads
one line saying so, errors.Stopped) and refuses new ones for a while; the daemon
calls it on a signal (mount.py), and `overlayckpt unmount` sends the
`interrupt` command before it unmounts. Writes to ctl run in parallel, each
client's command beside the others (interpose.c asks the kernel for parallel
direct writes); where the C library does not serve the mount the kernel runs one
at a time (it holds the file's lock for the whole command), so a client that must
get through while a command runs first has the daemon call it (SIGUSR1).
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import pyfuse3
import trio

from overlayckpt.agents.hooks import MAX_HOOK_LINE
from overlayckpt.errors import FsError, Stopped, UserError
from overlayckpt.fuse.attrs import VirtualAttr, virtual_attrs
from overlayckpt.messages import InterruptRequest, Request, StatusReply, parse
from overlayckpt.names import shown
from overlayckpt.records import CONTROL_INO_BASE, CONTROL_NAME, ROOT_INO

log = logging.getLogger(__name__)
R = TypeVar("R")

KEPT = 3600.0  # seconds the kernel may keep what never changes (see the module doc)
DIR_INO = CONTROL_INO_BASE + 1
CTL_INO = CONTROL_INO_BASE + 2
STATUS_INO = CONTROL_INO_BASE + 3
CONV_INO = CONTROL_INO_BASE + 4
CKPTS_INO = CONTROL_INO_BASE + 5
VIEW_INO_BASE = CONTROL_INO_BASE + (1 << 32)

MAX_LINE = 1 << 20  # one command or conversation line; longer is EINVAL
# an agent's hook event, written whole (agents/lines.parse_line takes it apart)
CONV_MAX_LINE = MAX_HOOK_LINE
# ctl's size as the kernel sees it: the kernel runs writes that end below it in parallel
# (see interpose.c, fuse_reply_open), so no client's command waits for another's to
# finish; small enough that a read of "the whole file" (Python's read()) is no burden
CTL_SIZE = 2 * MAX_LINE
# seconds an interrupt waits for the cut-short commands' clients to close ctl
STOP_GRACE = 0.5
INSTANT = frozenset({"status", "set_apply", "stats"})  # never refused: they hold ctl for no time

FILES = {b"ctl": CTL_INO, b"status.json": STATUS_INO, b"conversation.jsonl": CONV_INO,
         b"checkpoints": CKPTS_INO}


def _no_constant(word: str) -> object:
    raise ValueError(f"{word} is not a JSON number")


def _check_values(value: object) -> None:
    """Refuse what no command takes, before any command sees it: a string with a NUL (no
    path, name or message holds one) or with a surrogate that is not one of a file name's
    undecodable bytes (U+DC80..U+DCFF: how a name that is not UTF-8 travels in JSON)."""
    if isinstance(value, str):
        if "\0" in value:
            raise UserError(f"the command holds the string {shown(value)} with a NUL character: "
                            "no path, name or message may hold one")
        if any(0xD800 <= ord(c) <= 0xDFFF and not 0xDC80 <= ord(c) <= 0xDCFF for c in value):
            raise UserError(f"the command holds the string {shown(value)}, which is not valid "
                            "Unicode: send UTF-8 text")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_values(k)
            _check_values(v)
    elif isinstance(value, list):
        for v in value:
            _check_values(v)


class ControlTarget(Protocol):
    """What the control directory needs from the running session (service.session.Session)."""

    async def command(self, cmd: Request[R]) -> R: ...
    def status(self) -> StatusReply: ...
    def conversation_text(self) -> bytes: ...
    def conversation_append(self, line: bytes) -> None: ...


class Views(Protocol):
    """Read-only checkpoint views (see views.py)."""

    async def lookup(self, parent: int, name: bytes) -> pyfuse3.EntryAttributes: ...
    async def getattr(self, ino: int) -> pyfuse3.EntryAttributes: ...
    async def listing(self, ino: int) -> list[tuple[bytes, pyfuse3.EntryAttributes]]: ...
    async def readlink(self, ino: int) -> bytes: ...
    async def read(self, ino: int, off: int, size: int) -> bytes: ...
    def root_attr(self, cid: int) -> pyfuse3.EntryAttributes: ...
    def listing_mtime_ns(self) -> int: ...


@dataclass(slots=True, eq=False)
class ControlHandle:
    ino: int
    flags: int
    pending: bytearray = field(default_factory=bytearray)
    reply: bytearray = field(default_factory=bytearray)
    snapshot: bytes | None = None
    discarding: bool = False
    replied: int = 0  # bytes of reply already read: ctl reads are a stream, like a socket


class ControlFs:
    def __init__(self, session: ControlTarget, views: Views | None = None) -> None:
        self.session = session
        self.views = views
        self._refuse_until = 0.0  # (trio clock) until then, commands get Stopped's line
        self._running: set[trio.CancelScope] = set()  # one per command running
        self._cut: set[ControlHandle] = set()  # handles told Stopped, not yet closed

    def _attr(self, v: VirtualAttr) -> pyfuse3.EntryAttributes:
        return virtual_attrs(v)

    def _vattr(self, ino: int) -> VirtualAttr:
        if ino == DIR_INO:
            return VirtualAttr(ino, stat.S_IFDIR | 0o755, entry_timeout=KEPT, attr_timeout=KEPT)
        if ino == CKPTS_INO:
            # the kernel keeps this listing (see fuse/csrc/fastpath.c) until the mtime changes
            mtime_ns = self.views.listing_mtime_ns() if self.views is not None else 0
            return VirtualAttr(ino, stat.S_IFDIR | 0o755, mtime_ns=mtime_ns, entry_timeout=KEPT)
        if ino == CTL_INO:
            return VirtualAttr(ino, stat.S_IFREG | 0o600, CTL_SIZE, entry_timeout=KEPT,
                               attr_timeout=KEPT)
        # the mounting user's only (attrs.py: owned by the daemon's uid; the mount has
        # default_permissions, so the kernel checks these modes for every user, also
        # under allow_other): the conversation holds what was typed to the agent
        if ino == STATUS_INO:
            return VirtualAttr(ino, stat.S_IFREG | 0o400, entry_timeout=KEPT)
        if ino == CONV_INO:
            return VirtualAttr(ino, stat.S_IFREG | 0o600, len(self.session.conversation_text()),
                               entry_timeout=KEPT)
        raise FsError(errno.ENOENT)

    async def lookup(self, parent: int, name: bytes) -> pyfuse3.EntryAttributes:
        if parent == ROOT_INO and name == CONTROL_NAME:
            return self._attr(self._vattr(DIR_INO))
        if parent == DIR_INO and name in FILES:
            return self._attr(self._vattr(FILES[name]))
        if self.views is not None and (parent == CKPTS_INO or parent >= VIEW_INO_BASE):
            return await self.views.lookup(parent, name)
        raise FsError(errno.ENOENT)

    async def getattr(self, ino: int) -> pyfuse3.EntryAttributes:
        if ino >= VIEW_INO_BASE and self.views is not None:
            return await self.views.getattr(ino)
        return self._attr(self._vattr(ino))

    async def setattr(self, ino: int) -> pyfuse3.EntryAttributes:
        # `echo ... > ctl` truncates before writing: accept it as a no-op.
        if ino in (CTL_INO, CONV_INO):
            return self._attr(self._vattr(ino))
        raise FsError(errno.EROFS if ino >= VIEW_INO_BASE else errno.EPERM)

    async def readlink(self, ino: int) -> bytes:
        if self.views is None:
            raise FsError(errno.EINVAL)
        return await self.views.readlink(ino)

    async def listing(self, ino: int) -> list[tuple[bytes, pyfuse3.EntryAttributes]]:
        if ino == DIR_INO:
            out = [(b".", self._attr(self._vattr(DIR_INO))), (b"..", self._attr(self._vattr(DIR_INO)))]
            return out + [(name, self._attr(self._vattr(i))) for name, i in FILES.items()]
        if ino == CKPTS_INO or ino >= VIEW_INO_BASE:
            if self.views is None:
                return []
            return await self.views.listing(ino)
        raise FsError(errno.ENOTDIR)

    async def open(self, ino: int, flags: int) -> ControlHandle:
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        if ino >= VIEW_INO_BASE:
            if writing or flags & os.O_TRUNC:
                raise FsError(errno.EROFS)
            return ControlHandle(ino, flags)
        if ino in (DIR_INO, CKPTS_INO):
            raise FsError(errno.EISDIR)
        if ino == STATUS_INO and writing:
            raise FsError(errno.EACCES)
        handle = ControlHandle(ino, flags)
        if ino == STATUS_INO:
            # (interruptible: SIGUSR1 interrupts commands; to an older daemon it is fatal)
            status = {**self.session.status(), "interruptible": True}
            handle.snapshot = (json.dumps(status, indent=2) + "\n").encode()
        elif ino == CONV_INO and flags & os.O_ACCMODE != os.O_WRONLY:
            # (not for a writer, a hook appending one line: the text is the whole history)
            handle.snapshot = self.session.conversation_text()
        return handle

    async def read(self, h: ControlHandle, off: int, size: int) -> bytes:
        if h.ino >= VIEW_INO_BASE and self.views is not None:
            return await self.views.read(h.ino, off, size)
        if h.ino == CTL_INO:
            # the write moved the file offset; replies are read from where reading left off
            data = bytes(h.reply[h.replied:h.replied + size])
            h.replied += len(data)
            return data
        return (h.snapshot or b"")[off:off + size]

    async def write(self, h: ControlHandle, off: int, buf: bytes) -> int:
        if h.ino not in (CTL_INO, CONV_INO):
            raise FsError(errno.EROFS if h.ino >= VIEW_INO_BASE else errno.EPERM)
        lines = self._take_lines(h, buf)
        if h.ino == CTL_INO and h.pending.strip() and not h.discarding:
            # a last command without its newline still runs if it is complete JSON
            try:
                json.loads(h.pending)
            except Exception:
                pass
            else:
                lines.append(bytes(h.pending))
                h.pending.clear()
        failed: int | None = None  # the errno the write fails with
        for line in lines:
            if line is None:
                failed = errno.EINVAL
                if h.ino == CTL_INO:
                    self._reply(h, {"ok": False, "error": f"line longer than {MAX_LINE} bytes: "
                                                         "this handle takes no more; reopen ctl"})
            elif h.ino == CTL_INO:
                failed = await self._run(h, line) or failed
            else:
                try:
                    self.session.conversation_append(line)
                except UserError:
                    failed = errno.EINVAL
        if failed:
            raise FsError(failed)
        return len(buf)

    @staticmethod
    def _take_lines(h: ControlHandle, buf: bytes) -> list[bytes | None]:
        """The complete, non-blank lines buf finishes; None for a line over MAX_LINE.

        After an over-long line the handle refuses everything: a writer retrying
        after EINVAL would otherwise have the tail of that line run as a command.
        """
        if h.discarding:
            return [None]
        limit = CONV_MAX_LINE if h.ino == CONV_INO else MAX_LINE
        out: list[bytes | None] = []
        h.pending += buf
        while b"\n" in h.pending:
            line, _, rest = bytes(h.pending).partition(b"\n")
            h.pending[:] = rest
            if len(line) > limit:
                h.discarding = True
                h.pending.clear()
                return out + [None]
            if line.strip():
                out.append(line)
        if len(h.pending) > limit:
            h.pending.clear()
            h.discarding = True
            out.append(None)
        return out

    async def _run(self, h: ControlHandle, line: bytes) -> int | None:
        """Run one command line; the errno its failure gives the write, or None."""
        try:
            raw = json.loads(line, parse_constant=_no_constant)
            _check_values(raw)
            cmd = parse(raw)
        except UserError as e:
            self._reply(h, {"ok": False, "error": str(e)})
            return errno.EINVAL
        except json.JSONDecodeError as e:
            self._reply(h, {"ok": False, "error": f"malformed JSON: {e}"})
            return errno.EINVAL
        except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
            why = str(e) if "JSON number" in str(e) else ("a number too long, nesting too deep "
                                                         "or bytes that are not UTF-8")
            self._reply(h, {"ok": False, "error": f"malformed JSON: {why}"})
            return errno.EINVAL
        if isinstance(cmd, InterruptRequest):  # (not a session's command)
            self._reply(h, {"ok": True, "interrupted": await self.interrupt()})
            return None
        with trio.CancelScope() as scope:
            self._running.add(scope)
            try:
                if trio.current_time() < self._refuse_until and cmd.CMD not in INSTANT:
                    raise Stopped()
                # (a ValueError from inside a command is our bug, not malformed input: below)
                result = await self.session.command(cmd)
            except (UserError, FsError) as e:
                if isinstance(e, Stopped):
                    self._cut.add(h)
                # (what a command that failed part way changed: PartlyDone's details)
                self._reply(h, {**getattr(e, "details", {}), "ok": False, "error": str(e)})
                store_failed = isinstance(e, FsError) and e.errno in (errno.ENOSPC, errno.EIO)
                return e.errno if store_failed else errno.EINVAL  # type: ignore[union-attr]  # store_failed: e is an FsError
            except Exception as e:  # a bad command must never take the daemon or the reply down
                log.exception("control command failed: %r", line[:200])
                self._reply(h, {"ok": False, "error": f"{cmd.CMD} failed unexpectedly "
                                                     f"({e}): daemon.log has the details"})
                return errno.EINVAL
            finally:
                self._running.discard(scope)
        if scope.cancelled_caught:
            self._cut.add(h)
            self._reply(h, {"ok": False, "error": str(Stopped())})
            return errno.EINVAL
        self._reply(h, {"ok": True, **result})
        return None

    async def interrupt(self, refuse: float = 0.0) -> int:
        """Cut short every command running, and refuse new ones for `refuse` seconds
        (math.inf: for good). Returns the number cut short, once their clients have
        closed ctl (so that an unmount does not find the mount busy), or STOP_GRACE on."""
        self._refuse_until = max(self._refuse_until, trio.current_time() + refuse)
        running = list(self._running)
        for scope in running:
            scope.cancel()
        with trio.move_on_after(STOP_GRACE):
            while self._running or self._cut:
                await trio.sleep(0.005)
        return len(running)

    async def stop(self) -> None:
        """The daemon stops: every command from now on is refused."""
        await self.interrupt(math.inf)

    @staticmethod
    def _reply(h: ControlHandle, obj: Mapping[str, object]) -> None:
        h.reply += (json.dumps(obj) + "\n").encode()

    async def release(self, h: ControlHandle) -> None:
        self._cut.discard(h)
        if h.ino == CONV_INO and h.pending.strip():
            try:
                self.session.conversation_append(bytes(h.pending))
            except UserError:
                pass
