"""Which snapshot of a store to trust when it was not closed cleanly, and its check.

After a kill -9 the page cache holds every commit: LMDB's newest snapshot is intact.
After a power cut it may not: the store rolls back to the snapshot synced.py recorded
at the last sync point, whose pages were pinned until a newer record was durable.
Either way lmdb's offline verifier checks what LMDB would open before it touches it,
and a store that fails is refused (StoreDamaged) with one line naming `recover`.
"""
from __future__ import annotations

import logging

import lmdb
import lmdb.verify

from overlayckpt.errors import StoreDamaged
from overlayckpt.store import synced

log = logging.getLogger(__name__)


def way_out(path: str) -> str:
    """What a refusal of the damaged store at path tells the user to do."""
    return (f"run 'overlayckpt --store {path} recover' to salvage what can be read into a "
            "new store (the damaged one is kept beside it)")


def _verify(path: str) -> list[str]:
    """lmdb's offline verifier on the snapshot LMDB would open: every page it reaches."""
    try:
        return lmdb.verify.verify(path)
    except (lmdb.verify.VerifyError, OSError) as e:
        return [str(e)]


def trust_snapshot(path: str, rec: synced.Record | None) -> bool:
    """Before LMDB opens an existing store: pick the snapshot to trust, and verify it.

    Returns whether the last daemon's page cache may be gone (then the store was rolled
    back to its last recorded sync point). The newest snapshot is kept only if the page
    cache survived (same incarnation) and everything it reaches verifies; else the
    recorded one. Raises StoreDamaged if that fails verification too.
    """
    newest = synced.newest_txnid(path, rec.psize if rec else 4096)
    if rec is not None and rec.clean and newest == rec.txnid:
        return False  # closed cleanly: nothing after the record
    cache_lost = rec is not None and (rec.ident != synced.incarnation(path)
                                      or newest is None or newest < rec.txnid)
    if cache_lost and newest != rec.txnid:  # type: ignore[union-attr]  # cache_lost: rec is set
        log.warning("store %s was not closed and its page cache is gone (power cut?): "
                    "rolling back to its last sync point (transaction %d, was %s)",
                    path, rec.txnid, newest)  # type: ignore[union-attr]  # cache_lost: rec is set
        try:
            synced.roll_back(path, rec)  # type: ignore[arg-type]  # cache_lost: rec is set
        except OSError as e:
            raise StoreDamaged(f"store {path} cannot be rolled back to its last sync point "
                               f"({e.strerror}): {way_out(path)}") from None
    problems = _verify(path)
    if problems and not cache_lost and rec is not None and newest is not None \
            and newest > rec.txnid:
        # the incarnation said the page cache survived, yet what the newest meta page
        # reaches is damaged: it did not (a cut the incarnation cannot tell). The
        # recorded snapshot's pages were pinned since it was recorded: never rewritten
        log.warning("store %s: its newest snapshot (transaction %d) is damaged (%s): "
                    "rolling back to its last sync point (transaction %d)",
                    path, newest, problems[0], rec.txnid)
        try:
            synced.roll_back(path, rec)
        except OSError as e:
            raise StoreDamaged(f"store {path} cannot be rolled back to its last sync point "
                               f"({e.strerror}): {way_out(path)}") from None
        cache_lost = True
        problems = _verify(path)
    if problems:
        raise StoreDamaged(f"store {path} is damaged ({problems[0]}; {len(problems)} "
                           f"problem(s)): nothing was served; {way_out(path)}")
    return cache_lost
