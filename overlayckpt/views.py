"""Read-only views of checkpoints under .overlayckpt/checkpoints/."""
from __future__ import annotations

import errno
from typing import TYPE_CHECKING

import pyfuse3

from .errors import FsError

if TYPE_CHECKING:
    from .session import Session


class CheckpointViews:
    def __init__(self, session: "Session") -> None:
        self.s = session

    async def lookup(self, parent: int, name: bytes) -> pyfuse3.EntryAttributes:
        raise FsError(errno.ENOENT)

    async def getattr(self, ino: int) -> pyfuse3.EntryAttributes:
        raise FsError(errno.ENOENT)

    async def listing(self, ino: int) -> list[tuple[bytes, pyfuse3.EntryAttributes]]:
        return []

    async def readlink(self, ino: int) -> bytes:
        raise FsError(errno.EINVAL)

    async def read(self, ino: int, off: int, size: int) -> bytes:
        raise FsError(errno.EIO)
