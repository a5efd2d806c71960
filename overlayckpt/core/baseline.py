"""The repo baseline: what the session records of a repo file when it first changes it,
and the digest apply compares with to tell a file the repo rewrote unchanged from one it
changed. The table holding it is named `seen` (tables.SEEN): that name is part of the
store format and stays.

A `seen` record is [ino, size, mtime_ns] and, for a small file, the blake3 digest of
its content; for a git index (`.git/index`, a worktree's index) the digest of its
entries (path, mode, object id, flags) instead, since git rewrites an index's stat
cache (a plain `git status` does) without changing what it stages. A file whose
digest is still the same has not changed in any way an apply could lose.
"""
from __future__ import annotations

import os
import struct
from collections.abc import Callable
from typing import Any

import blake3

from overlayckpt.core.lower import Lower, openat2_beneath
from overlayckpt.records import Node, pack_obj, path_cut, path_key

# a file up to this size is hashed when first changed (once per file per session)
HASH_MAX = 256 << 10
INDEX_MAX = 64 << 20  # a git index up to this size has its entries hashed
_HEADER = struct.Struct(">4sII")
_STAT = 40  # ctime, mtime (s, ns), dev, ino, mode, uid, gid, size: 10 x u32
_OID = 20  # sha1 (a sha256 repo's index does not parse: it is hashed whole, if small)


def is_git_index(path: bytes) -> bool:
    parts = path.split(b"/")
    return len(parts) >= 2 and parts[-1] == b"index" and (
        parts[-2] == b".git" or (len(parts) >= 4 and parts[-3] == b"worktrees"
                                 and parts[-4] == b".git"))


def index_entries(data: bytes) -> list[tuple[int, bytes, int, bytes]] | None:
    """(mode, object id, flags without the name length, path) of each entry of a git
    index (versions 2 to 4), or None if data is not one."""
    if len(data) < _HEADER.size:
        return None
    sig, version, count = _HEADER.unpack_from(data)
    if sig != b"DIRC" or version not in (2, 3, 4):
        return None
    out = []
    pos, prev = _HEADER.size, b""
    try:
        for _ in range(count):
            start = pos
            mode = struct.unpack_from(">I", data, pos + 24)[0]
            oid = data[pos + _STAT:pos + _STAT + _OID]
            pos += _STAT + _OID
            flags = struct.unpack_from(">H", data, pos)[0]
            pos += 2
            if flags & 0x4000 and version >= 3:  # extended flags (skip-worktree, intent-to-add)
                flags |= struct.unpack_from(">H", data, pos)[0] << 16
                pos += 2
            if version == 4:  # the path as: strip n bytes of the previous one, add a suffix
                byte = data[pos]
                pos += 1
                strip = byte & 0x7F
                while byte & 0x80:  # git's offset varint (varint.c)
                    byte = data[pos]
                    pos += 1
                    strip = ((strip + 1) << 7) | (byte & 0x7F)
                end = data.index(b"\0", pos)
                path = prev[:len(prev) - strip] + data[pos:end]
                pos = end + 1
            else:
                end = data.index(b"\0", pos)
                path = data[pos:end]
                pos = start + ((end - start) // 8 + 1) * 8  # NUL-padded to 8 bytes
            out.append((mode, oid, flags & ~0xFFF, path))
            prev = path
    except (struct.error, ValueError, IndexError):
        return None
    return out


def _entries_digest(data: bytes) -> bytes | None:
    entries = index_entries(data)
    if entries is None:
        return None
    h = blake3.blake3(b"index-entries\0")
    for mode, oid, flags, path in entries:
        h.update(struct.pack(">II", mode, flags) + oid + path + b"\0")
    return h.digest()


def _read_all(size: int, read: Callable[[int, int], bytes]) -> bytes:
    parts, off = [], 0
    while off < size:
        chunk = read(min(size - off, 1 << 20), off)
        if not chunk:
            break
        parts.append(chunk)
        off += len(chunk)
    return b"".join(parts)


def content_digest(path: bytes, size: int, read: Callable[[int, int], bytes]) -> bytes | None:
    """The digest `seen` keeps of a file (read(n, off) reads it), or None if it keeps
    none (a big file: apply then compares it with the live content only)."""
    if is_git_index(path) and size <= INDEX_MAX:
        data = _read_all(size, read)
        found = _entries_digest(data)
        if found is not None:
            return found
        return blake3.blake3(data).digest() if size <= HASH_MAX else None
    if size > HASH_MAX:
        return None
    return blake3.blake3(_read_all(size, read)).digest()


def seen_record(lower: Lower, ino: int, node: Node) -> list[Any]:
    """The `seen` record of a repo entry the session is about to change first."""
    record: list[Any] = [ino, node.size, node.mtime_ns]
    if node.is_reg and node.origin is not None:
        try:
            f = lower.open_file(node.origin)
        except OSError:
            return record
        try:
            digest = content_digest(node.origin, node.size, f.pread)
        except OSError:
            digest = None
        finally:
            f.close()
        if digest is not None:
            record.append(digest)
    return record


def seen_key(path: bytes) -> bytes:
    return path_key(b"/", path)


def seen_value(key: bytes, path: bytes, record: list[Any]) -> bytes:
    """record packed; one whose path is too long for its key keeps it fifth, after the
    digest (None when there is none)."""
    if path_cut(key, 1):
        record = record[:4] + [None] * (4 - len(record[:4])) + [path]
    return pack_obj(record)


def seen_path(key: bytes, record: list[Any]) -> bytes:
    return record[4] if path_cut(key, 1) else key[1:]


def repo_digest(dirfd: int, path: bytes, size: int) -> bytes | None:
    """content_digest of the repo's file at path now (None if unreadable)."""
    try:
        fd = openat2_beneath(dirfd, path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return content_digest(path, size, lambda n, off: os.pread(fd, n, off))
    except OSError:
        return None
    finally:
        os.close(fd)
