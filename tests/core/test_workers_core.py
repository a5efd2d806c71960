"""Worker threads of commands (service/workers.py): a cancelled one stops at its next
read of the store, so that the store can be closed under no reader."""
from __future__ import annotations

import threading

import trio

from overlayckpt.core.workers import off_loop, wait_idle
from overlayckpt.errors import Stopped
from overlayckpt.service.session import Session
from overlayckpt.store.lmdbstore import Store
from overlayckpt.store.txn import ReadTxn
from overlayckpt.tables import META

DEADLINE = 60.0


async def test_a_cancelled_worker_stops_at_its_next_read(session: Session) -> None:
    reading = threading.Event()
    ended: list[BaseException] = []

    def endless(store: Store) -> None:
        def fn(r: ReadTxn) -> None:
            while True:  # a walk that would never end by itself
                r.count(META)
                reading.set()
        try:
            store.read(fn)
        except BaseException as e:
            ended.append(e)
            raise

    async with trio.open_nursery() as nursery:
        nursery.start_soon(off_loop, session.store, endless)
        await trio.to_thread.run_sync(reading.wait, DEADLINE)
        nursery.cancel_scope.cancel()  # returns at once: the thread was abandoned
    assert await trio.to_thread.run_sync(wait_idle, DEADLINE)
    assert len(ended) == 1 and isinstance(ended[0], Stopped)


async def test_a_worker_that_is_not_cancelled_returns_its_result(session: Session) -> None:
    assert await off_loop(session.store, lambda store: store.read(lambda r: r.count(META))) > 0
    assert wait_idle(0)
