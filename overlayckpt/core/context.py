"""What the core needs of a session: its store, lower and overlay, and two kernel hooks.

Built once (by Session.open, with the hooks the mount passes) and handed to the
Timeline, the Applier, the conversation functions and the checkpoint views, so
that none of them depends on the service layer above. The hooks are async and
default to no-ops: a session opened without a mount has no kernel cache to drop.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

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


class Readers(Protocol):
    """The mount's reader processes (service/reader.py): a reading by its name there."""

    async def call(self, name: str, cmd: Any) -> Mapping[str, object]: ...


@dataclass(slots=True)
class Elsewhere:
    """Where long read-only work runs beside the mount: its reader processes, once the
    daemon has started them (None: in a worker thread). A worker thread's Python holds
    the GIL that the request loop needs; a reader is a process of its own."""
    readers: Readers | None = None


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
