"""The inodes whose attributes the daemon made the kernel forget (a restore's), which a
walk asks for next, one GETATTR each.

Python answers the first GETATTR of a run of them, and publishes the attributes of the
next ones to C (fuse/csrc/names.c), whose reader thread answers their GETATTRs while
they do not change: one Python round trip per RUN inodes rather than one per inode.
"Next" is in inode order: the daemon numbers a directory's entries together, as a walk
first finds them, so neighbours are mostly the entries the walk stats next.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from itertools import islice

RUN = 256  # inodes published with each GETATTR Python answers of them
MOST = 1 << 17  # inodes kept at most (as many as C's table holds)


class Forgotten:
    def __init__(self) -> None:
        self.inodes: list[int] = []  # sorted

    def add(self, inodes: Iterable[int]) -> None:
        # (bounded work on the loop, whatever a restore changed: MOST at most taken)
        self.inodes = sorted(set(self.inodes).union(islice(inodes, MOST)))[:MOST]

    def take(self, ino: int) -> list[int]:
        """ino and the forgotten inodes after it (RUN in all at most), now no longer
        forgotten, if ino is one; else []."""
        i = bisect_left(self.inodes, ino)
        if i == len(self.inodes) or self.inodes[i] != ino:
            return []
        run = self.inodes[i:i + RUN]
        del self.inodes[i:i + RUN]
        return run
