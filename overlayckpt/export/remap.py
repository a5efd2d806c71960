"""Import into another checkout: check the target repo against a bundle's header and
rewrite the lower inodes held in store entries from the recorded repo's to the target's.
"""
from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Mapping
from typing import Any

from overlayckpt.core.pins import seen_fingerprint
from overlayckpt.errors import UserError
from overlayckpt.export.identity import entry_identity, identities
from overlayckpt.records import (
    FIRST_UPPER_INO,
    LOWER_INO_ONE,
    ROOT_INO,
    TABLE_NAMES,
    WHITEOUT,
    Checkpoint,
    JournalRecord,
    Node,
    from_u64,
    lower_ino,
    pack_obj,
    u64,
    unpack_obj,
)
from overlayckpt.tables import (
    BMAP,
    CKPTS,
    DIRENTS,
    JOURNAL,
    META,
    NEXT_INO_KEY,
    NODES,
    PINNED,
    SEEN,
    XATTRS,
)


def _rows(header: Mapping[str, object], key: str) -> list[Any]:
    """A list of the header's (bundle.header_problem checked its shape), empty if absent."""
    rows = header.get(key, [])
    assert isinstance(rows, list)
    return rows


def check_repo(header: Mapping[str, object], repo: str) -> None:
    """Refuse a repo that is not the directory the session recorded (its inodes differ)."""
    pinned = {bytes(p) for p in _rows(header, "pinned")}
    for ino, origin in _rows(header, "lower"):
        if origin in pinned:
            continue  # the store keeps the original: what the repo holds now does not matter
        try:
            st = os.lstat(os.path.join(os.fsencode(repo), origin))
        except OSError:
            st = None
        if st is None or lower_ino(st.st_ino) != ino:
            raise UserError(f"{repo} is not the repo as this session recorded it ({os.fsdecode(origin)} "
                            "is missing or another file now): import over that same, unchanged "
                            "directory (--repo)")


def repo_remap(header: Mapping[str, object], repo: str, bundle_path: str) -> Remap | None:
    """How the inodes of the recorded repo become those of repo, after checking that repo
    holds what the session refers to; None when repo is the recorded directory (same inodes)."""
    if header.get("lower_files") is None:  # a bundle from before lower_files: only the same directory will do
        check_repo(header, repo)
        return None
    # a number given out by the overlay (a pin an earlier import renumbered) is no repo's
    files = [f for f in _rows(header, "lower_files") if ROOT_INO < f[0] < FIRST_UPPER_INO]
    dirfd = os.open(repo, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # the same directory: nothing to hash or rewrite, exactly as before lower_files; a
        # pinned path counts too: gone, its number may now be another file's
        if all((found := entry_identity(dirfd, path, content=False)) is not None
               and lower_ino(found[0].st_ino) == ino for ino, path, *_ in files):
            return None
        inos: dict[int, int] = {}
        absent: list[int] = []
        identity = identities(dirfd)
        for ino, path, kind, size, digest in files:
            found = identity(path) if kind is not None else entry_identity(dirfd, path, content=False)
            if kind is None:  # pinned: the store keeps the original, any content will do
                if found is not None:
                    inos[ino] = lower_ino(found[0].st_ino)
                else:
                    absent.append(ino)  # never keep its number: here it may be another file's
                continue
            if found is None or found[1] != [kind, size, digest]:
                why = ("is missing" if found is None else "is another type of file"
                       if found[1][0] != kind else "has other content")
                name = os.fsdecode(path)
                raise UserError(f"{repo} is not the repo this session was recorded on: {name} {why} "
                                f"there: import into a checkout of the same commit with {name} as "
                                "it was (--repo)")
            inos[ino] = lower_ino(found[0].st_ino)
        paths = {ino: path for ino, path, *_ in files}
        for ino, nlink in _rows(header, "lower_links"):  # (absent from older bundles)
            found = identity(paths[ino]) if ino in paths else None
            if found is not None and found[0].st_nlink != nlink:
                name = os.fsdecode(paths[ino])
                raise UserError(f"{name} has {nlink} names (hard links) in the repo this session "
                                f"was recorded on but {found[0].st_nlink} in {repo}: import into a "
                                "checkout that keeps hard links, e.g. a 'cp -a' copy (--repo)")
        seen: dict[bytes, list[int]] = {}
        for path, size, digest in _rows(header, "seen_files"):
            found = identity(path)
            if found is not None and found[1] == [stat.S_IFREG, size, digest]:
                seen[path] = seen_fingerprint(found[0])
    finally:
        os.close(dirfd)
    # two recorded files must not become one (hard links the recorded repo did not have)
    owner: dict[int, int] = {}
    for old, new in inos.items():
        first = owner.setdefault(new, old)
        if first != old:
            a, b = os.fsdecode(paths[first]), os.fsdecode(paths[old])
            raise UserError(f"{a} and {b} are one file (hard links) in {repo} but not in the repo "
                            "this session was recorded on: import into a checkout where they are "
                            "separate files (--repo)")
    return Remap(inos, seen, bundle_path, absent)


class Remap:
    """Rewrites the lower inodes held in store entries from the recorded repo's to the target's.

    They are: the keys of nodes, dirents, bmap and xattrs (the inode comes first), dirent
    values, a node's parent hint, the same in journal undo entries, a pin's st_ino and the
    inode `seen` fingerprints. Root, upper and control inodes never change. Where absent
    pinned files get fresh numbers, the checkpoints' inode counters become unknown.

    A pinned path the target lacks gets a fresh overlay number (from `next_ino`), never its
    recorded one: the target may have given that number to another file, which the mount
    would then serve with the pinned file's content. meta, the first table of a bundle,
    gives `next_ino` before any row that holds an inode."""

    def __init__(self, inos: dict[int, int], seen: dict[bytes, list[int]], path: str,
                 absent: list[int]) -> None:
        self.inos, self.seen, self.path = inos, seen, path
        self.absent = absent
        self.next_ino: int | None = None  # the bundle's, once its meta row has passed
        self.numbered = False

    def _number_absent(self) -> None:
        base = FIRST_UPPER_INO if self.next_ino is None else self.next_ino
        for i, ino in enumerate(self.absent):
            self.inos[ino] = base + i
        self.numbered = True

    def meta_rows(self) -> list[tuple[bytes, bytes]]:
        """What to add to meta after the load: next_ino past the fresh numbers, if the
        bundle had none (its session never created a file)."""
        if self.absent and self.next_ino is None:
            return [(NEXT_INO_KEY, u64(FIRST_UPPER_INO + len(self.absent)))]
        return []

    def ino(self, ino: int, hint: bool = False) -> int:
        if not ROOT_INO < ino < FIRST_UPPER_INO:
            return ino
        new = self.inos.get(ino)
        if new is None:
            if hint:
                return 0  # a parent hint: 0 means unknown, ancestors() finds it from the origin
            raise UserError(f"{self.path} refers to repo inode {ino} without naming its path: import "
                            "over the directory the session was recorded on (--repo)")
        return new

    def _head(self, b: bytes) -> bytes:
        return u64(self.ino(from_u64(b[:8]))) + b[8:]

    def entry(self, table: bytes, key: bytes, value: bytes | None) -> tuple[bytes, bytes | None]:
        if table in (NODES, DIRENTS, BMAP, XATTRS):
            key = self._head(key)
        if value is None:
            return key, None
        if table == NODES:
            node = Node.unpack(value)
            node.parent = self.ino(node.parent, hint=True)
            value = node.pack()
        elif table == DIRENTS and value != WHITEOUT:
            value = self._head(value)
        elif table == JOURNAL:
            rec = JournalRecord.unpack(from_u64(key), value)
            undo = []
            for t, k, v in rec.undo:  # (table, key, old value): encoded as in the tables
                k, v = self.entry(TABLE_NAMES[t], k, v)
                undo.append((t, k, v))
            value = dataclasses.replace(rec, undo=tuple(undo)).pack()
        elif table == PINNED:
            pin = unpack_obj(value)
            new = self.inos.get(lower_ino(pin["st"][1]))
            if new is not None:
                pin["st"][1] = 1 if new == LOWER_INO_ONE else new  # st_ino as lstat gave it
                value = pack_obj(pin)
        elif table == CKPTS and self.absent:
            # the fresh numbers of absent pinned files are above every checkpoint's counter,
            # yet those files were there: no counter says what did not exist
            value = dataclasses.replace(Checkpoint.unpack(from_u64(key), value), next_ino=0).pack()
        elif table == SEEN and key[1:] in self.seen:
            # [ino, size, mtime] of the repo's file: the target's when it holds the same
            # content; otherwise the old one stays, and apply compares the content
            value = pack_obj(self.seen[key[1:]])
        return key, value

    def row(self, table: bytes, key: bytes, value: bytes) -> tuple[bytes, bytes]:
        if table == META:
            if key != NEXT_INO_KEY:
                return key, value
            if self.numbered or len(value) != 8:
                raise UserError(f"{self.path} is damaged (its meta table is out of place): "
                                "export the bundle again")
            self.next_ino = from_u64(value)
            return key, u64(self.next_ino + len(self.absent))
        if not self.numbered:
            self._number_absent()
        key, new = self.entry(table, key, value)
        return key, new if new is not None else value
