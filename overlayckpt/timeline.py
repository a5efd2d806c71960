"""Checkpoints on top of the journal: list, name, view, diff and restore."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .records import Checkpoint, from_u64

if TYPE_CHECKING:
    from .session import Session


class Timeline:
    def __init__(self, session: "Session") -> None:
        self.s = session
        self.store = session.store

    def latest(self) -> Checkpoint | None:
        def fn(r):  # type: ignore[no-untyped-def]
            for k, v in r.range_from(b"ckpts", reverse=True):
                return Checkpoint.unpack(from_u64(k), v)
            return None
        return self.store.read(fn)
