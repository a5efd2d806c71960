"""Repo identity: the lower entries a session refers to (by inode and path), what each is
(type, size, content digest), and the pinned and `seen` files, as a bundle records
them and an import checks them against the target repo.
"""
from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Any

import blake3

from overlayckpt.core.baseline import seen_path
from overlayckpt.core.lower import lstat_beneath, openat2_beneath
from overlayckpt.core.pins import pinned_path, seen_fingerprint
from overlayckpt.errors import FsError
from overlayckpt.records import (
    FIRST_UPPER_INO,
    ROOT_INO,
    T_NODES,
    JournalRecord,
    Node,
    from_u64,
    lower_ino,
    unpack_obj,
)
from overlayckpt.store.txn import ReadTxn
from overlayckpt.tables import JOURNAL, NODES, PINNED, SEEN


def lower_identity(r: ReadTxn) -> tuple[list[list[Any]], list[bytes]]:
    """The lower inodes the session refers to, with their paths, and the pinned paths."""
    inos: dict[int, bytes] = {}

    def note(ino: int, raw: bytes) -> None:
        if ROOT_INO < ino < FIRST_UPPER_INO and ino not in inos:
            node = Node.unpack(raw)
            if node.origin is not None:
                inos[ino] = node.origin

    for k, v in r.range_from(NODES):
        note(from_u64(k), v)
    for k, v in r.range_from(JOURNAL):
        for table, key, old in JournalRecord.unpack(from_u64(k), v).undo:
            if table == T_NODES and old:
                note(from_u64(key), old)
    pinned = [pinned_path(k, unpack_obj(v)) for k, v in r.range_from(PINNED)]
    return [[ino, path] for ino, path in sorted(inos.items())], pinned


def entry_identity(dirfd: int, path: bytes, content: bool = True
                   ) -> tuple[os.stat_result, list[Any]] | None:
    """The lstat of the entry at a path below dirfd and what import compares of it: [type,
    size, blake3 of the content or link target] ([] without content); None if absent."""
    st = lstat_beneath(dirfd, path)
    if st is None or not content:
        return None if st is None else (st, [])
    kind = stat.S_IFMT(st.st_mode)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        return st, [kind, 0, None]  # directories and the like: their type is what we check
    h, size = blake3.blake3(), 0
    try:
        # O_PATH opens a symlink itself (no follow), and readlinkat(fd, "") reads it
        fd = openat2_beneath(dirfd, path, os.O_PATH if stat.S_ISLNK(st.st_mode) else os.O_RDONLY)
        try:
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(b"", dir_fd=fd)
                h.update(target)
                size = len(target)
            else:
                while chunk := os.read(fd, 1 << 20):
                    h.update(chunk)
                    size += len(chunk)
        finally:
            os.close(fd)
    except (OSError, FsError):
        return None
    return st, [kind, size, h.digest()]


Identity = Callable[[bytes], "tuple[os.stat_result, list[Any]] | None"]


def identities(dirfd: int) -> Identity:
    """entry_identity of paths below dirfd, each looked up (and its file hashed) once:
    a file the session both refers to and has `seen` is asked for twice."""
    memo: dict[bytes, tuple[os.stat_result, list[Any]] | None] = {}

    def identity(path: bytes) -> tuple[os.stat_result, list[Any]] | None:
        if path not in memo:
            memo[path] = entry_identity(dirfd, path)
        return memo[path]
    return identity


def lower_files(r: ReadTxn, identity: Identity, lower: list[list[Any]]) -> list[list[Any]]:
    """What import checks another checkout against: [ino, path, type, size, digest] of every
    lower entry the session refers to, read through the lower fd (never through our own
    mount); type None for pinned paths, which the store keeps (with the pin's inode)."""
    out: dict[int, list[Any]] = {}
    for k, v in r.range_from(PINNED):
        if k != b"/":  # the root is always ROOT_INO
            pin = unpack_obj(v)
            out.setdefault(lower_ino(pin["st"][1]), [pinned_path(k, pin), None, None, None])
    pinned = {e[0] for e in out.values()}
    for ino, path in lower:
        if path in pinned:
            out.setdefault(ino, [path, None, None, None])
        elif ino not in out:
            found = identity(path)
            out[ino] = [path, *found[1]] if found is not None else [path, 0, 0, None]
    return [[ino, *rest] for ino, rest in sorted(out.items())]


def lower_links(identity: Identity, files: list[list[Any]]) -> list[list[int]]:
    """[ino, number of names] of the referenced regular files the repo holds under more
    than one name: a checkout that split those hard links would show the session's
    changes under one name only, so import refuses it."""
    out = []
    for ino, path, kind, *_ in files:
        found = identity(path) if kind == stat.S_IFREG else None
        if found is not None and found[0].st_nlink > 1:
            out.append([ino, found[0].st_nlink])
    return out


def seen_files(r: ReadTxn, identity: Identity) -> list[list[Any]]:
    """[path, size, digest] of the files the repo still holds as `seen` (apply's conflict
    check) recorded them: import gives a checkout holding the same content their fingerprint."""
    out = []
    for k, v in r.range_from(SEEN):
        rec = unpack_obj(v)
        path = seen_path(k, rec)
        found = identity(path)
        if (found is not None and stat.S_ISREG(found[0].st_mode)
                and rec[:3] == seen_fingerprint(found[0])):
            out.append([path, found[1][1], found[1][2]])
    return out
