"""Attributes as pyfuse3 wants them: of stored nodes (the overlay and the checkpoint
views) and of the virtual entries of the control directory. Used by ops.py,
control.py and views.py; imports none of them."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass

import pyfuse3

from overlayckpt.fuse.fastpath import ENTRY_OUT, U64
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


_TIMEOUT_S = int(CACHE_TIMEOUT)
_TIMEOUT_NS = int((CACHE_TIMEOUT - _TIMEOUT_S) * 1e9)
_pack_entry = ENTRY_OUT.pack


def entry_record(ino: int, node: Node, block_size: int) -> bytes:
    """What entry_attrs answers, as the struct fuse_entry_out C publishes (fastpath.py's
    _entry_out of it, byte for byte): a walk publishes every name it lists, and making
    the attributes first cost as much again."""
    size = node.size
    atime, atime_ns = divmod(node.atime_ns, 1_000_000_000)
    mtime, mtime_ns = divmod(node.mtime_ns, 1_000_000_000)
    ctime, ctime_ns = divmod(node.ctime_ns, 1_000_000_000)
    return _pack_entry(ino, 0, _TIMEOUT_S, _TIMEOUT_S, _TIMEOUT_NS, _TIMEOUT_NS,
                       ino, size, (size + 511) // 512, atime & U64, mtime & U64, ctime & U64,
                       atime_ns, mtime_ns, ctime_ns, node.mode, max(node.nlink, 0), node.uid,
                       node.gid, node.rdev, block_size, 0)


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
