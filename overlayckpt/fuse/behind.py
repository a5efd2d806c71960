"""What the daemon answers before it is stored: writes C acknowledged (write-behind,
fuse/csrc/behind.c) and creates and removals (core/answered.py), each deferred to the
next write transaction (Store.defer) and committed soon after (store_soon); and
the gate that makes writes wait when the store runs too far ahead of the disk.
"""
from __future__ import annotations

import errno
import logging
import os
import time

import trio

from overlayckpt.core import writebehind
from overlayckpt.core.context import Invalidate
from overlayckpt.core.journal import Caller
from overlayckpt.core.latency import Captures
from overlayckpt.core.overlay import Overlay, keep_up
from overlayckpt.errors import FsError
from overlayckpt.fuse import fastpath

log = logging.getLogger(__name__)

STORE_DEFERRED_TURNS = 8
# Deferred writes of at most FOLD_BYTES wait up to FOLD_WAIT seconds for the next write
# transaction: where a commit costs more than their capture.
FOLD_BYTES = 8192
FOLD_WAIT = 0.002


class Behind:
    def __init__(self, overlay: Overlay, capture: Captures, invalidate: Invalidate) -> None:
        self.ov = overlay
        self.capture = capture
        self.invalidate = invalidate
        overlay.store.on_deferred_stored = self._captured_later
        # a write that finds the store too far ahead of the disk waits off the loop (keep_up)
        overlay.store.writes_wait = False
        # inode -> errno of a write that failed after C acknowledged it; fsync reports it
        self.failed_writes: dict[int, int] = {}
        self._disk_gate = trio.Lock()
        self._held = False  # write-behind paused until the disk has caught up
        self.failed = False  # stopped for good: the store failed a write
        self._fd: int | None = None  # the log, to turn write-behind on again
        self._storing_soon = False  # _store_deferred_soon is on its way

    def may_answer_first(self) -> bool:
        """Whether an operation may be answered before it is stored: while the store's
        disk has room for it (as C asks before it acknowledges a write; on a full disk
        the operation itself fails) and the store has not failed a write."""
        free = self.ov.store.free_bytes()
        return not self.failed and free is not None and free >= fastpath.MIN_FREE
    async def keep_up(self) -> None:
        """Wait (off the loop) if the store is too far ahead of the disk; once it has
        caught up, acknowledge writes early again."""
        await keep_up(self.ov.store, self._disk_gate)
        if self._held and not self.failed:
            if self._fd is None:
                self._fd = writebehind.open_log(self.ov.store.path)
            fastpath.write_behind(self._fd, writebehind.LOG_SIZE, *writebehind.position(self.ov.store))
        self._held = False

    def _hold_write_behind(self) -> None:
        """An acknowledged write must be stored now, in order, so it cannot wait: when the
        store is too far ahead of the disk, acknowledge no more, and the writes that come
        instead wait in keep_up."""
        if not self._held and self.ov.store.too_far_ahead():
            fastpath.stop_write_behind()
            self._held = True

    def _captured_later(self, arrivals: list[int]) -> None:
        """Writes acknowledged before their capture (write-behind) are in the store now."""
        self.capture.after_reply.record_since(time.monotonic_ns(), arrivals)

    def write(self, caller: Caller, ino: int, off: int, buf: bytes,
              logged: tuple[int, int], arrival: int) -> int:
        """Store a write whose writer was told it is done (see fuse/csrc/behind.c), with the next
        write transaction or soon after (Overlay.write_later): a failure can only be kept
        for the file's next fsync, as a native file system does."""
        done = writebehind.pack_position(*logged)
        self._hold_write_behind()

        def failed(e: Exception) -> None:
            err = e.errno if isinstance(e, FsError) else errno.EIO
            log.error("a write of %d bytes at %d to inode %d failed after it was acknowledged "
                      "(%s); the file's next fsync reports it", len(buf), off, ino,
                      os.strerror(err), exc_info=not isinstance(e, FsError))
            self.failed_writes.setdefault(ino, err)
            try:
                writebehind.skip(self.ov.store, done)
            except FsError:
                pass  # then a replay fails the same way
            if err not in (errno.ESTALE, errno.ENOENT):
                # the store itself failed (full, broken): from now on each write waits
                # for its own answer; a file a restore removed concerns that file only
                fastpath.stop_write_behind()
                self.failed = True
            try:  # the kernel's pages hold what was not stored
                trio.lowlevel.spawn_system_task(self.invalidate, [ino], [])
            except RuntimeError:
                pass  # stored at unmount, outside the loop: the kernel holds nothing any more

        self.ov.write_later(caller, ino, off, buf, done, failed, arrival)
        self.store_soon()
        return len(buf)

    def store_soon(self) -> None:
        if not self._storing_soon:
            self._storing_soon = True
            trio.lowlevel.spawn_system_task(self._store_deferred_soon)

    async def _store_deferred_soon(self) -> None:
        """Commit the deferred writes: a few small ones with the next write transaction
        (a file's create and its first write then cost one commit, not two), or
        FOLD_WAIT from now; more, once no request waits (those queued may add to them),
        or after a few turns of the loop: its tasks may all be waiting on something else.
        (Capturing a 20 KiB atomic save's write on the rename's path, not while the loop
        was idle, made the save 7-15% slower.)"""
        try:
            if self.ov.store.deferred_bytes() <= FOLD_BYTES:
                await trio.sleep(FOLD_WAIT)
            for _ in range(STORE_DEFERRED_TURNS):
                if not (fastpath.requests_waiting() and self.ov.store.deferred()):
                    break
                await trio.sleep(0)
        finally:
            self._storing_soon = False
            try:
                self.ov.store.store_deferred()
            except Exception:  # each write's own failure is handled; not this
                log.exception("storing deferred writes failed")

