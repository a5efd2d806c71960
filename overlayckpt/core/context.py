"""What the core needs of a session: its store, lower and overlay, and two kernel hooks.

Built once (by Session.open, with the hooks the mount passes) and handed to the
Timeline, the Applier, the conversation functions and the checkpoint views, so
that none of them depends on the service layer above. The hooks are async and
default to no-ops: a session opened without a mount has no kernel cache to drop.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from overlayckpt.core.lower import Lower
from overlayckpt.core.overlay import Overlay
from overlayckpt.store.lmdbstore import Store

# (inodes, (parent, name) entries) whose kernel caches a restore made stale
Invalidate = Callable[[list[int], list[tuple[int, bytes]]], Awaitable[None]]
FlushKernel = Callable[[], Awaitable[None]]


async def no_invalidate(inodes: list[int], entries: list[tuple[int, bytes]]) -> None:
    return None


async def no_flush() -> None:
    return None


# a reading (service/registry.py READINGS) by name, where no request of the mount waits
# for it: Session.reading (a reader process of the mount, else a worker thread)
Reading = Callable[[str, Any], Awaitable[Mapping[str, object]]]


@dataclass(slots=True)
class Elsewhere:
    """Where the core has long read-only work done: set by the session that holds the
    context (it is made before the session). A worker thread's Python holds the GIL
    the request loop needs; the mount's reader is a process of its own."""
    read: Reading | None = None


@dataclass(frozen=True, slots=True)
class Context:
    store: Store
    lower: Lower
    overlay: Overlay
    repo: str
    mountpoint: str | None = None
    # drop kernel caches of what a restore changed (the mount: pyfuse3.invalidate_*)
    invalidate: Invalidate = no_invalidate
    # have the kernel send every dirty page before a restore (the mount: syncfs)
    flush_kernel: FlushKernel = no_flush
    elsewhere: Elsewhere = field(default_factory=Elsewhere)

    @property
    def mounted(self) -> bool:
        return self.mountpoint is not None
