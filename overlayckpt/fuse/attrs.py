"""Attributes as pyfuse3 wants them: of stored nodes (the overlay and the checkpoint
views) and of the virtual entries of the control directory. Used by ops.py,
control.py and views.py; imports none of them."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass

import pyfuse3

from overlayckpt.records import Node

# The daemon is the only writer of what it serves and invalidates the kernel
# caches itself when it changes something on its own (restore), so the kernel
# may keep entries and attributes for a long time.
CACHE_TIMEOUT = 3600.0


@dataclass(frozen=True, slots=True)
class VirtualAttr:
    ino: int
    mode: int
    size: int = 0
    mtime_ns: int = 0
    entry_timeout: float = 0.0
    attr_timeout: float = 0.0


def entry_attrs(ino: int, node: Node, block_size: int) -> pyfuse3.EntryAttributes:
    a = pyfuse3.EntryAttributes()
    a.st_ino = ino
    a.generation = 0
    a.entry_timeout = CACHE_TIMEOUT
    a.attr_timeout = CACHE_TIMEOUT
    a.st_mode = node.mode
    a.st_nlink = max(node.nlink, 0)
    a.st_uid = node.uid
    a.st_gid = node.gid
    a.st_rdev = node.rdev
    a.st_size = node.size
    a.st_blksize = block_size
    a.st_blocks = (node.size + 511) // 512
    a.st_atime_ns = node.atime_ns
    a.st_mtime_ns = node.mtime_ns
    a.st_ctime_ns = node.ctime_ns
    return a


def virtual_attrs(v: VirtualAttr) -> pyfuse3.EntryAttributes:
    a = pyfuse3.EntryAttributes()
    a.st_ino = v.ino
    a.entry_timeout = v.entry_timeout
    a.attr_timeout = v.attr_timeout
    a.st_mode = v.mode
    a.st_nlink = 2 if stat.S_ISDIR(v.mode) else 1
    a.st_uid = os.getuid()
    a.st_gid = os.getgid()
    a.st_size = v.size
    a.st_blksize = 4096
    a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = v.mtime_ns
    return a
