"""Writing the live state (or a checkpoint) into the repo, and pinning the
original lower entries it replaces so history keeps seeing them."""
from __future__ import annotations

from .lower import Pin, PinLookup
from .store import Store


def pin_lookup(store: Store) -> PinLookup | None:
    if store.read(lambda r: r.count(b"pinned")) == 0:
        return None
    return None


def apply_live(session) -> None:  # type: ignore[no-untyped-def]
    raise NotImplementedError
