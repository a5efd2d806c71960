"""Worker threads for the read-only work of commands (diffs, line counts, a whole-store
check, a bundle), and how they stop.

A command awaits its worker in the request loop; when that wait is cancelled (the
daemon stops: SIGTERM, or an unmount), the loop stops waiting at once and the
thread is told to stop: the reads it makes through the store it was given raise
Stopped from then on, so a worker walking the store ends within one read. A
worker stuck elsewhere (a system call) is abandoned: the daemon waits for the
workers a bounded time (wait_idle) and otherwise exits without closing LMDB
under a live read transaction (closing it would crash the process).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import trio

from overlayckpt.errors import Stopped
from overlayckpt.store.lmdbstore import Store
from overlayckpt.store.txn import ReadTxn

T = TypeVar("T")

_idle = threading.Condition()
_busy = 0  # worker threads of this process running a command's function


class _StoppableRead(ReadTxn):
    """A read view whose reads raise Stopped once its command was cancelled."""

    def __init__(self, r: ReadTxn, stop: threading.Event) -> None:
        super().__init__(r.store, r.txn)
        self._stop = stop

    def _check(self) -> None:
        if self._stop.is_set():
            raise Stopped()

    def get(self, table: bytes, key: bytes) -> bytes | None:
        self._check()
        return super().get(table, key)

    def block(self, digest: bytes) -> bytes:
        self._check()
        return super().block(digest)

    def count(self, table: bytes) -> int:
        self._check()
        return super().count(table)

    def prefix(self, table: bytes, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        for item in super().prefix(table, prefix):
            self._check()
            yield item

    def range_from(self, table: bytes, start: bytes = b"", reverse: bool = False
                   ) -> Iterator[tuple[bytes, bytes]]:
        for item in super().range_from(table, start, reverse):
            self._check()
            yield item


class _StoppableStore:
    """The store as a worker sees it: every read view is a _StoppableRead."""

    def __init__(self, store: Store, stop: threading.Event) -> None:
        self._store = store
        self._stop = stop

    def read(self, fn: Callable[[ReadTxn], T]) -> T:
        if self._stop.is_set():
            raise Stopped()
        return self._store.read(lambda r: fn(_StoppableRead(r, self._stop)))

    def __getattr__(self, name: str) -> Any:  # everything else is the store's own
        return getattr(self._store, name)


async def off_loop(store: Store, fn: Callable[[Store], T]) -> T:
    """fn(store) in a worker thread (it must only read). Cancelling the caller returns at
    once and stops the worker at its next read of the store."""
    store.store_deferred()  # what the worker reads includes every write before the command
    stop = threading.Event()

    def work() -> T:
        global _busy
        with _idle:
            # (a thread that starts after its command was cancelled, perhaps after the
            # store closed, never touches it; one counted here is waited for)
            if stop.is_set():
                raise Stopped()
            _busy += 1
        try:
            return fn(cast(Store, _StoppableStore(store, stop)))
        finally:
            with _idle:
                _busy -= 1
                _idle.notify_all()
    try:
        return await trio.to_thread.run_sync(work, abandon_on_cancel=True)
    except BaseException:
        stop.set()
        raise


async def read_off_loop(store: Store, fn: Callable[[ReadTxn], T]) -> T:
    """fn in a read view of its own, in a worker thread: off_loop of one store.read."""
    return await off_loop(store, lambda worker_store: worker_store.read(fn))


def wait_idle(timeout: float) -> bool:
    """Wait until no worker runs a command's function, at most timeout seconds."""
    deadline = time.monotonic() + timeout
    with _idle:
        while _busy:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _idle.wait(left)
    return True
