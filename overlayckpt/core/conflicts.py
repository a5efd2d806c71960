"""Conflicts between an apply and changes made to the repo itself since the session
first changed a file (the `seen` records: core/baseline.py): apply refuses to overwrite
such a change unless the result would be the same bytes anyway, and after an apply
records what the repo now holds, which later applies compare with.
"""
from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from typing import Any

from overlayckpt.core.baseline import is_git_index, repo_digest, seen_key, seen_path, seen_value
from overlayckpt.core.lower import lstat_beneath, openat2_beneath
from overlayckpt.core.overlay import Overlay
from overlayckpt.core.pins import seen_fingerprint
from overlayckpt.errors import FsError, UserError
from overlayckpt.records import Node, unpack_obj
from overlayckpt.store.lmdbstore import Store
from overlayckpt.store.txn import ReadTxn
from overlayckpt.tables import SEEN

# (file fd, state, inode, node) -> whether the file holds the node's content there
SameContent = Callable[[int, Any, int, Node], bool]


def seen_records(store: Store) -> list[tuple[bytes, list[Any]]]:
    """Each repo path the session changed, with what it recorded of it then."""
    def fn(r: ReadTxn) -> list[tuple[bytes, list[Any]]]:
        records = ((k, unpack_obj(v)) for k, v in r.range_from(SEEN))
        return [(seen_path(k, rec), rec) for k, rec in records]
    return store.read(fn)


def refuse_conflicts(store: Store, fd: int, ov: Overlay, state: Any, same_content: SameContent) -> None:
    """Refuse to overwrite a file that changed in the repo since the session first
    changed it, unless the result would be the same bytes anyway."""
    conflicts = []
    for path, seen in seen_records(store):
        real = lstat_beneath(fd, path)
        if seen[:3] != seen_fingerprint(real):
            why = _conflict(fd, ov, state, path, seen, real, same_content)
            if why is not None:
                conflicts.append(why)
    if conflicts:
        more = f"; and {len(conflicts) - 3} more" if len(conflicts) > 3 else ""
        raise UserError(f"the repo itself changed since the session first changed these "
                        f"files ({'; '.join(conflicts[:3])}{more}): applying would overwrite "
                        "that; save those changes, or apply --force")


def _conflict(fd: int, ov: Overlay, state: Any, path: bytes, seen: list[Any],
              real: os.stat_result | None, same_content: SameContent) -> str | None:
    """What differs in the repo's copy of path (None: nothing an apply would lose)."""
    name = os.fsdecode(path)
    if real is None:
        return f"{name} was removed in the repo"
    if not stat.S_ISREG(real.st_mode):
        return f"{name} is no longer a regular file in the repo"
    if len(seen) > 3 and repo_digest(fd, path, real.st_size) == seen[3]:
        return None  # rewritten with the same content (a git index: the same entries)
    try:
        live_ino = ov.resolve(state, name)
        node: Node | None = ov.node(state, live_ino)
    except FsError:
        node = None
    if node is not None and node.is_reg and node.size == real.st_size:
        file_fd = openat2_beneath(fd, path, os.O_RDONLY | os.O_NONBLOCK)  # (a fifo: never wait)
        try:
            if same_content(file_fd, state, live_ino, node):
                return None
        finally:
            os.close(file_fd)
    if is_git_index(path) and len(seen) > 3:
        return f"{name} stages other entries in the repo than when the session began"
    how = [f"size {seen[1]} -> {real.st_size} bytes"] if seen[1] != real.st_size else []
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(real.st_mtime_ns / 1e9))
    how.append(f"modified {when}" if seen[2] != real.st_mtime_ns else "replaced")
    return f"{name} changed in the repo after the session changed it ({', '.join(how)})"


def remember_repo(store: Store, fd: int) -> None:
    """After an apply the repo holds what we wrote: that is what later applies compare with."""
    updates = []
    for path, _ in seen_records(store):
        st = lstat_beneath(fd, path)
        record: list[Any] = seen_fingerprint(st)
        try:
            digest = repo_digest(fd, path, st.st_size) if st and stat.S_ISREG(st.st_mode) else None
        except (FsError, OSError):  # gone or replaced since: the next apply sees the change
            digest = None
        key = seen_key(path)
        updates.append((key, seen_value(key, path, record + ([digest] if digest else []))))

    def fn(w: Any) -> None:
        for key, value in updates:
            w.put(SEEN, key, value)
    store.write(fn)
