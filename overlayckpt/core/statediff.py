"""What differs between two states of the tree, path by path: the diff behind
`diff`, `backout`, git export, forks and a restore's file list (timeline.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from overlayckpt.core.overlay import Overlay
from overlayckpt.errors import FsError
from overlayckpt.messages import Change
from overlayckpt.records import FIRST_UPPER_INO, ROOT_INO, WHITEOUT, Node, from_u64, u64
from overlayckpt.tables import DIRENTS, NODES


@dataclass(frozen=True, slots=True)
class FileChange:
    path: str
    change: str  # A M D
    old: tuple[int, bytes] | None  # (mode, content or link target)
    new: tuple[int, bytes] | None


def lookup_or_none(ov: Overlay, state: Any, parent: int | None, name: bytes,
                   siblings: bool = True) -> int | None:
    if parent is None:
        return None
    try:
        return ov.lookup(state, parent, name, siblings)
    except FsError:
        return None


class StateDiff:
    """The files that differ between two states of one overlay (any state: the live
    tree, a checkpoint's, one with a restore's undo laid over it)."""

    def __init__(self, ov: Overlay) -> None:
        self.ov = ov

    def file_changes(self, sa: Any, sb: Any, keys: set[tuple[bytes, bytes]],
                     one_sided: set[int], content: bool) -> list[FileChange]:
        """The paths whose entries differ between states sa and sb, given the keys that
        differ and the inodes with a node record in one state only. Without content, a
        file whose records differ counts as modified."""
        dirty_inos = {from_u64(k[:8]) for t, k in keys if t != DIRENTS}
        dirty_dirs = {from_u64(k[:8]) for t, k in keys if t == DIRENTS}
        # An overlay inode exists only where it has a record, under a name added or removed
        # in between: that name's directory is dirty, so the walk up starts there.
        walk_up = (dirty_inos | dirty_dirs) - {i for i in one_sided if i >= FIRST_UPPER_INO}
        above: set[int] = set()
        for state in (sa, sb):
            seen: set[int] = set()  # per state: a directory may sit elsewhere in the other
            for ino in walk_up:
                self.ov.ancestors(state, ino, seen)
            above |= seen
        names = self._names(sa, sb, keys, (walk_up | above) - {ROOT_INO})
        out: list[FileChange] = []
        self._diff_dir(sa, sb, ROOT_INO, ROOT_INO, "", dirty_inos, dirty_dirs | above, out, content,
                       names)
        return out

    def _names(self, sa: Any, sb: Any, keys: set[tuple[bytes, bytes]], inos: set[int]
               ) -> dict[int, set[bytes]] | None:
        """Directory -> the names in it that can differ between sa and sb: the changed entries,
        and the names of the changed inodes and of the directories above them. So a diff
        visits what changed, not every entry of the directories it passes through. None
        where a changed file has several names (hard links: no index finds them all)."""
        out: dict[int, set[bytes]] = {}
        named: dict[tuple[int, int], tuple[int, bytes]] = {}  # (state, ino) -> a changed entry's
        for t, k in keys:
            if t == DIRENTS:
                parent, name = from_u64(k[:8]), k[8:]
                out.setdefault(parent, set()).add(name)
                for state in (sa, sb):
                    value = state.get(DIRENTS, k)
                    if value is not None and value != WHITEOUT:
                        named[(id(state), from_u64(value))] = (parent, name)
        listings: dict[tuple[int, int], dict[int, list[bytes]]] = {}
        dirs: dict[bytes, int | None] = {b"": ROOT_INO}
        for state in (sa, sb):
            for ino in inos:
                raw = state.get(NODES, u64(ino))
                node = Node.unpack(raw) if raw else None
                if node is not None and not node.is_dir and node.nlink > 1:
                    return None
                for parent, name in self._names_of(state, ino, node, listings, dirs, named):
                    out.setdefault(parent, set()).add(name)
        return out

    def _names_of(self, state: Any, ino: int, node: Node | None,
                  listings: dict[tuple[int, int], dict[int, list[bytes]]],
                  dirs: dict[bytes, int | None],
                  named: dict[tuple[int, int], tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """Where ino (of one name: _names sees to that) may be named in state: its lower path
        (until it moves, a repo entry keeps it) with the name of every repo directory down
        to it (a process that never looked them up, a reader or a new daemon, knows no other
        way to them), and the overlay entry of the directory its record names as its parent:
        a changed entry's or its live name where that entry leads to it there, else found
        in that directory's listing (which costs every name it ever held)."""
        out: list[tuple[int, bytes]] = []
        origin = node.origin if node is not None else self.ov.lower_paths.get(ino)
        if ino < FIRST_UPPER_INO and origin:
            path = b""
            parts = origin.split(b"/")
            for depth, name in enumerate(parts, 1):
                parent = dirs.get(path)
                if parent is None:
                    break
                out.append((parent, name))
                path = path + b"/" + name if path else name
                if depth < len(parts) and path not in dirs:  # (once per directory and diff)
                    try:
                        dirs[path] = self.ov.ino_of_lower(self.ov.lower.stat(path, False), path)
                    except FsError:
                        dirs[path] = None
        hint = node.parent if node is not None and (node.nlink or node.is_dir) else 0
        if hint:  # (a file of no links is named nowhere: unlinked, it may still be open)
            where = named.get((id(state), ino))  # (read in that state already: it leads to ino)
            if where is None or where[0] != hint:
                where = self.ov.parents.get(ino)
                if where is not None and (where[0] != hint or
                                          state.get(DIRENTS, u64(hint) + where[1]) != u64(ino)):
                    where = None
            if where is not None:
                return out + [where]
            by_ino = listings.get((id(state), hint))
            if by_ino is None:  # (once per directory and state: it may hold many)
                by_ino = listings[(id(state), hint)] = {}
                for key, value in state.prefix(DIRENTS, u64(hint)):
                    if value != WHITEOUT:
                        by_ino.setdefault(from_u64(value), []).append(key[8:])
            out += [(hint, name) for name in by_ino.get(ino, ())]
        return out

    def _content(self, state: Any, ino: int, node: Node) -> tuple[int, bytes]:
        if node.is_link:
            return node.mode, self.ov.readlink(state, ino, node)
        if node.is_reg:
            return node.mode, self.ov.read_all(state, ino, node)
        return node.mode, b""

    def _diff_dir(self, sa: Any, sb: Any, ia: int | None, ib: int | None, prefix: str,
                  dirty_inos: set[int], dirty_dirs: set[int], out: list[FileChange],
                  content: bool, names: dict[int, set[bytes]] | None) -> None:
        if names is not None and ia is not None and ia == ib:  # only the names that can differ
            ea: dict[bytes, tuple[int, Node | None]] = {}
            eb: dict[bytes, tuple[int, Node | None]] = {}
            for name in names.get(ia, ()):
                for state, entries in ((sa, ea), (sb, eb)):
                    child = lookup_or_none(self.ov, state, ia, name, siblings=False)
                    if child is not None:
                        entries[name] = (child, None)
        else:  # a directory on one side only, or another one: every entry
            ea = {n: (c, cn) for n, c, cn in self.ov.entries(sa, ia)} if ia is not None else {}
            eb = {n: (c, cn) for n, c, cn in self.ov.entries(sb, ib)} if ib is not None else {}
        for name in sorted(set(ea) | set(eb)):
            path = prefix + os.fsdecode(name)
            a, b = ea.get(name), eb.get(name)
            na = (a[1] or self.ov.node(sa, a[0])) if a else None
            nb = (b[1] or self.ov.node(sb, b[0])) if b else None
            a_dir, b_dir = na is not None and na.is_dir, nb is not None and nb.is_dir
            if a and b and a[0] == b[0] and a[0] not in dirty_inos and a[0] not in dirty_dirs:
                continue  # same inode, untouched in between: same content and subtree
            if a_dir or b_dir:
                if a_dir and b_dir and a[0] == b[0] and a[0] not in dirty_dirs:  # type: ignore[index]  # a_dir, b_dir: a and b are set
                    continue
                self._diff_dir(sa, sb, a[0] if a_dir else None, b[0] if b_dir else None,  # type: ignore[index]  # a_dir, b_dir: a and b are set
                               path + "/", dirty_inos, dirty_dirs, out, content, names)
            has_a, has_b = a is not None and not a_dir, b is not None and not b_dir
            if not content:
                if has_a or has_b:
                    code = (Change.MODIFIED if has_a and has_b
                            else Change.ADDED if has_b else Change.DELETED)
                    out.append(FileChange(path, code, None, None))
                continue
            ca = self._content(sa, a[0], na) if has_a else None  # type: ignore[index, arg-type]  # has_a: a and na are set
            cb = self._content(sb, b[0], nb) if has_b else None  # type: ignore[index, arg-type]  # has_b: b and nb are set
            if ca == cb:
                continue
            change = Change.ADDED if ca is None else Change.DELETED if cb is None else Change.MODIFIED
            out.append(FileChange(path, change, ca, cb))

