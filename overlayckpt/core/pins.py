"""Pins: the repo's original entries, kept in the store before apply changes them.

Before apply changes or removes any entry of the repo as the session first saw it,
that entry is *pinned*: its attributes, its content (as blocks) or its listing go
into the `pinned` table, and lower.py answers for that path from the pin from then
on. So every checkpoint that still refers to the original repo keeps seeing it
exactly, after any number of applies. Also what `seen` records of a repo entry.
"""
from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import NotRequired, TypedDict

from overlayckpt.core.lower import Lower, Pin, PinLookup, PinStat, join
from overlayckpt.errors import FsError
from overlayckpt.records import lower_ino, pack_obj, path_cut, path_key, unpack_obj
from overlayckpt.store.lmdbstore import Store
from overlayckpt.store.txn import ReadTxn
from overlayckpt.tables import PINNED


def pin_key(path: bytes) -> bytes:
    return path_key(b"/", path)  # LMDB keys cannot be empty, and the root's path is b""


class PinRecord(TypedDict):
    """A pin as stored (table pinned): the repo entry's stat fields and xattrs, and what
    its type has (a directory's names, a link's target, a file's blocks)."""
    st: list[int]
    xattrs: dict[bytes, bytes]
    entries: NotRequired[list[bytes]]
    target: NotRequired[bytes]
    blocks: NotRequired[list[bytes]]
    path: NotRequired[bytes]  # when too long for the key


def pinned_path(key: bytes, rec: PinRecord) -> bytes:
    """The path of the pin at key (rec: its record, which keeps a path too long for a key)."""
    return rec["path"] if path_cut(key, 1) else key[1:]


def pin_lookup(store: Store) -> PinLookup | None:
    if store.read(lambda r: r.count(PINNED)) == 0:
        return None
    bs = store.block_size

    def lookup(path: bytes) -> Pin | None:
        raw = store.read(lambda r: r.get(PINNED, pin_key(path)))
        if raw is None:
            return None
        rec = unpack_obj(raw)
        st = PinStat(*rec["st"])
        read: Callable[[int, int], bytes] | None = None
        if rec.get("blocks") is not None:
            blocks: list[bytes] = rec["blocks"]
            size = st.st_size

            def read_pinned(n: int, off: int) -> bytes:
                end = min(size, off + n)
                if off >= end:
                    return b""

                def fn(r: ReadTxn) -> bytes:  # every block of the range in one read transaction
                    out = []
                    pos = off
                    while pos < end:
                        b = pos // bs
                        stop = min(end, (b + 1) * bs)
                        out.append(r.block(blocks[b])[pos - b * bs:stop - b * bs])
                        pos = stop
                    return b"".join(out)
                return store.read(fn)
            read = read_pinned
        entries = rec.get("entries")
        return Pin(st, None if entries is None else set(entries), read, rec.get("target"), rec.get("xattrs") or {})
    return lookup


def pin(store: Store, lower: Lower, path: bytes, recursive: bool) -> int:
    """Keep the original lower entry at path (and, recursive, what is below it) in the
    store before apply changes it; how many entries were pinned."""
    if store.read(lambda r: r.get(PINNED, pin_key(path))) is not None:
        return 0
    try:
        st = lower.stat(path)  # the original (already pinned parts answer from pins)
    except FsError:
        return 0  # not part of the original lower: nothing to keep
    if lower.pins is not None and lower.pins(path) is not None:
        return 0
    n = 1
    rec: PinRecord = {"st": PinStat.fields(st), "xattrs": lower.xattrs(path)}
    if stat.S_ISDIR(st.st_mode):
        entries = lower.listdir(path)
        rec["entries"] = [name for name, _ in entries]
        if recursive:
            for name, _ in entries:
                n += pin(store, lower, join(path, name), True)
    elif stat.S_ISLNK(st.st_mode):
        rec["target"] = lower.readlink(path)
    elif stat.S_ISREG(st.st_mode):
        f = lower.open_file(path)
        try:
            bs = store.block_size
            blocks: list[bytes] = []
            for off in range(0, st.st_size, bs):
                data = f.pread(bs, off)
                data += bytes(bs - len(data))
                blocks.append(store.write(lambda w: w.put_block(data)))  # noqa: B023  (called at once)
            rec["blocks"] = blocks
        finally:
            f.close()
    key = pin_key(path)
    if path_cut(key, 1):
        rec["path"] = path
    raw = pack_obj(rec)
    store.write(lambda w: w.put(PINNED, key, raw))
    if lower.pins is None:
        lower.pins = pin_lookup(store)
    return n


def seen_fingerprint(st: os.stat_result | None) -> list[int]:
    """What `seen` records of a repo entry: inode, size, mtime; zeros for no entry."""
    return [lower_ino(st.st_ino), st.st_size, st.st_mtime_ns] if st is not None else [0, 0, 0]
