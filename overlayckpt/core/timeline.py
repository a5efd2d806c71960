"""Checkpoints on top of the journal: resolve, name, view, diff and restore.

A checkpoint is a journal position. The state at a checkpoint reads the live
tables through the history index (history.py): each key's value then is one
lookup away, and the keys changed since are one range, so a view costs
nothing to open, and a restore or diff costs the keys that changed, never the
journal in between nor the size of the repo. Restore writes the values then
into the live tables, journaled (itself undoable) as records of a few KB that
make a group of their own, and a `restore` checkpoint, then drops the kernel's
caches of the inodes and names it changed. The inodes made since the target it
leaves as they are, unnamed (delta.unborn_left), known by number from the target's
inode counter on: a subtree goes and comes back with its one entry, whatever it
holds; gc sweeps what stays unnamed (sweep.py). The files it adds, modifies and
deletes are written into those records after its answer (complete_restores).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from overlayckpt.core import groupfiles, history
from overlayckpt.core.context import Context
from overlayckpt.core.conversation import move_head
from overlayckpt.core.delta import Rows, differing, index_order, keys_between, note_restored, unborn_left, whole_restore
from overlayckpt.core.history import AtCheckpoint
from overlayckpt.core.journal import (
    Caller,
    append_closed,
    close_open_group,
    new_checkpoint,
    next_seq,
    records,
)
from overlayckpt.core.latency import Phases
from overlayckpt.core.statediff import FileChange, StateDiff, lookup_or_none
from overlayckpt.core.workers import read_off_loop
from overlayckpt.errors import FsError, UserError
from overlayckpt.messages import RestoreReply
from overlayckpt.names import check_checkpoint_name, check_message, name_key, parse_id, shown
from overlayckpt.records import (
    FIRST_UPPER_INO,
    ROOT_INO,
    TABLE_NAMES,
    Checkpoint,
    JournalRecord,
    from_u64,
    u64,
)
from overlayckpt.store.txn import ReadTxn, WriteTxn
from overlayckpt.tables import (
    CKPTS,
    CONV_HEAD_KEY,
    DIRENTS,
    JOURNAL,
    META,
    NAMES,
    NODES,
    RESTORE_FILES_KEY,
)

log = logging.getLogger(__name__)

TABLE_CODES = history.TABLE_CODES
# store -> the task listing its restores' files (complete_restores, after a restore's
# answer): the next restore stops it, so as not to share the GIL with it, and starts anew
_listing: dict[int, trio.CancelScope] = {}
# ... after this many seconds without another restore: the commands that follow a restore
# (a log, a diff, the agent's next edits) come first (a list of 60k keys costs ~250 ms of
# a worker, which holds the GIL)
LIST_AFTER = 2.0
RESTORE_FILES = "restore-files"  # the reading that runs restore_files (service/commands.py)


def stop_listing(store: Any) -> bool:
    """Stop the task listing a restore's files, if one runs (a command that must not share
    the GIL with it may call this; the next restore starts the listing again)."""
    scope = _listing.pop(id(store), None)
    if scope is not None:
        scope.cancel()
    return scope is not None
# a restore of some paths warns of files changed with them in at most this many newer groups
WARN_GROUPS = 1000
V = TypeVar("V")


def _fill_files(w: WriteTxn, lo: int, files: list[FileChange] | None) -> None:
    """Write a restore's file list into its records (shared out: each stays small), if
    they are still the ones left without it."""
    mark = RESTORE_FILES_KEY + u64(lo)
    end = w.get(META, mark)
    if end is None:
        return
    w.delete(META, mark)
    recs = records(w, lo, from_u64(end), undo=False)
    if files is None or any(rec.op != "restore" or rec.paths for rec in recs) or not recs:
        return
    for i, rec in enumerate(recs):
        mine = files[i * len(files) // len(recs):(i + 1) * len(files) // len(recs)]
        if mine:
            paths, changes = tuple(f.path for f in mine), tuple(f.change for f in mine)
            raw = JournalRecord.with_files(w.get(JOURNAL, u64(rec.seq)),  # type: ignore[arg-type]  # the record being listed is there
                                           paths, changes)
            w.put(JOURNAL, u64(rec.seq), raw)
            groupfiles.record(w, lo, paths, changes)  # (the restore's group begins at lo)


class _Replaced:
    """A state that differs from another in a few keys: before a restore, its records'
    undo entries over the state after it (no index lookup)."""

    def __init__(self, base: Any, values: dict[tuple[bytes, bytes], bytes | None]) -> None:
        self.base, self.values = base, values
        self.by_ino: dict[tuple[bytes, bytes], list[bytes]] = {}
        for table, key in values:
            self.by_ino.setdefault((table, key[:8]), []).append(key)

    def get(self, table: bytes, key: bytes) -> bytes | None:
        found = self.values.get((table, key), self)
        return self.base.get(table, key) if found is self else found  # type: ignore[return-value]  # self is the missing-key sentinel

    def prefix(self, table: bytes, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        mine = [k for k in self.by_ino.get((table, prefix[:8]), ()) if k.startswith(prefix)] \
            if len(prefix) >= 8 else [k for t, k in self.values if t == table and k.startswith(prefix)]
        if not mine:
            return self.base.prefix(table, prefix)
        return history.laid_over(self.base.prefix(table, prefix),
                                 ((key, self.values[(table, key)]) for key in mine))

    def block(self, digest: bytes) -> bytes:
        return self.base.block(digest)


def _under(path: str, wanted: list[str]) -> bool:
    return any(path == w or path.startswith(w + "/") for w in (p.strip("/") for p in wanted))


@dataclass(frozen=True, slots=True)
class Prepared:
    """A restore worked out in a snapshot (Timeline._prepare)."""
    target: Checkpoint
    seq: int  # the journal position of the snapshot
    records: int  # how many journal records it held
    rows: Rows  # the keys to write (their value then differs from now)
    warnings: list[str]
    left: set[bytes] | None  # a whole restore: the inodes whose keys it leaves as they are


class Timeline:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.ov = ctx.overlay

    # -- finding checkpoints ----------------------------------------------------

    def all(self, r: ReadTxn) -> list[Checkpoint]:
        return [Checkpoint.unpack(from_u64(k), v) for k, v in r.range_from(CKPTS)]

    def newest_first(self, r: ReadTxn) -> Iterator[Checkpoint]:
        """Checkpoints from the newest back (stop early: the history may be long)."""
        for k, v in r.range_from(CKPTS, reverse=True):
            yield Checkpoint.unpack(from_u64(k), v)

    def latest(self) -> Checkpoint | None:
        return self.store.read(lambda r: next(self.newest_first(r), None))

    def get(self, r: ReadTxn, ref: Any) -> Checkpoint:
        """A checkpoint by id, name, or @before-last (the state before the last restore or backout)."""
        if isinstance(ref, bool) or not isinstance(ref, (int, str)):
            raise UserError(f"checkpoint must be an id or a name, not {shown(ref)}")
        if isinstance(ref, str) and ref == "@before-last":
            for ck in self.newest_first(r):
                if ck.kind in ("restore", "backout"):
                    return self.get(r, ck.id - 1)  # see _mark_before_restore
            raise UserError("@before-last: there has been no restore yet")
        # ASCII digits are an id; anything else is looked up as a name exactly as given
        # (so a name stored before the rule of names.py, "-1" say, still finds its own)
        cid = ref if isinstance(ref, int) else parse_id(ref)
        if cid is None and isinstance(ref, str):  # (an int is always an id)
            key = name_key(ref)
            raw = r.get(NAMES, key) if key is not None else None
            if raw is not None:
                cid = from_u64(raw)
        raw = r.get(CKPTS, u64(cid)) if cid is not None and 0 <= cid < 1 << 63 else None
        if raw is None:
            raise UserError(f"unknown checkpoint {shown(ref)}: 'overlayckpt log' lists them")
        return Checkpoint.unpack(cid, raw)  # type: ignore[arg-type]  # raw found: cid is set

    # -- states ---------------------------------------------------------------

    def state(self, r: ReadTxn, ck: Checkpoint | None) -> Any:
        """The state at ck, or the live state for None."""
        if ck is None:
            return r
        return AtCheckpoint(r, ck.seq)

    # -- making checkpoints ---------------------------------------------------

    def checkpoint(self, name: str | None, message: str | None, caller: Caller) -> Checkpoint:
        if name is not None:
            check_checkpoint_name(name)
        if message is not None:
            check_message(message)

        def fn(w: WriteTxn) -> Checkpoint:
            if name is not None and w.get(NAMES, name.encode()) is not None:
                raise UserError(f"checkpoint name {shown(name)} is taken: pick another")
            close_open_group(w)
            seq = next_seq(w)
            return new_checkpoint(w, seq, seq, "named", name, message, caller.pid, caller.comm)
        return self.store.write(fn)

    def seal(self) -> None:
        """Close the pending group so the live state is a checkpoint of its own."""
        self.store.write(close_open_group)

    # -- restore --------------------------------------------------------------

    async def restore(self, ref: Any, caller: Caller, paths: list[str] | None = None,
                      what: str = "both") -> RestoreReply:
        """Put code, conversation or both back to a checkpoint, in one transaction.

        The values to put back are found first, in a worker thread and a snapshot, while
        the mount serves requests; the transaction then adds what was written since that
        snapshot, and writes. The files the restore adds, modifies and deletes are listed
        in its journal record later (complete_restores): nothing needs them before."""
        code = what in ("code", "both")
        listing = stop_listing(self.store)
        took = Phases()
        if code:
            await self.ctx.flush_kernel()
        took.end("flush")
        prep = await read_off_loop(self.store,
                                   lambda r: self._prepare(r, self.get(r, ref), paths, code))
        took.end("prepare")
        changed: list[tuple[bytes, bytes, bool]] = []
        ck = self.store.write(lambda w: self._write_restore(w, prep, caller, paths, what, changed))
        took.end("write")
        await self._invalidate(changed)
        took.end("invalidate")
        if (changed or listing) and self.ctx.mountpoint is not None:
            # (a system task: the daemon waits for its worker at exit, workers.wait_idle)
            trio.lowlevel.spawn_system_task(self.complete_restores_later)
        return {"id": ck.id, "restored": prep.target.id, "what": what,
                "changed_keys": len(changed), "warnings": prep.warnings, "took_ms": took.ms}

    def _write_restore(self, w: WriteTxn, prep: Prepared, caller: Caller,
                       paths: list[str] | None, what: str,
                       changed: list[tuple[bytes, bytes, bool]]) -> Checkpoint:
        """The restore's transaction: prep plus what was written since its snapshot. Every
        change to the live tables appends a journal record, so only the keys of records
        after the snapshot are read again; the rest is written blind, in key order."""
        code = what in ("code", "both")
        changed.clear()
        close_open_group(w)
        target = self.get(w, prep.target.id)  # (unknown now if thinning dropped it)
        self._mark_before_restore(w, caller)
        if what in ("conversation", "both"):
            move_head(w, target.conv_head)
        rows = prep.rows
        late = records(w, prep.seq, next_seq(w)) if code else []
        if late and paths is not None:  # (rare: redo the selection here, whole)
            rows = self._prepare(w, target, paths, code).rows
        elif late:
            rows = dict(rows)
            then = AtCheckpoint(w, target.seq)
            for rec in late:
                for tcode, key, _ in rec.undo:
                    table = TABLE_NAMES[tcode]
                    rows[(table, key)] = (then.get(table, key), w.get(table, key),
                                          history.newest(w, tcode, key))
            rows = unborn_left(dict(sorted(rows.items(), key=index_order)), prep.left)
        if w.count(JOURNAL) != prep.records + len(late):
            # (rare) thinning merged records since the snapshot: newest versions moved
            rows = {(t, k): (value, current, history.newest(w, TABLE_CODES[t], k))
                    for (t, k), (value, current, _) in rows.items()}
        undo: list[tuple[int, bytes, bytes | None]] = []
        newest: list[bytes | None] = []
        puts: dict[bytes, list[tuple[bytes, bytes]]] = {}
        deletes: dict[bytes, list[bytes]] = {}
        codes = TABLE_CODES
        for (table, key), (value, current, last) in rows.items():
            if current == value:
                continue  # (a key of a record after the snapshot)
            undo.append((codes[table], key, current))
            newest.append(last)
            if value is None:
                deletes.setdefault(table, []).append(key)
            else:
                puts.setdefault(table, []).append((key, value))
            changed.append((table, key, value is None))
        for table, keys in deletes.items():
            w.delete_many(table, keys)
        for table, items in puts.items():
            w.put_many(table, items)
        ck = append_closed(w, caller, "restore", undo, "restore", target.id, newest)
        if code:  # (what the next restore near this one starts from: delta.rows_near)
            note_restored(w, ck, target, prep.left if paths is None else None)
        if undo:
            w.put(META, RESTORE_FILES_KEY + u64(ck.start_seq), u64(ck.seq))
        return ck

    def _prepare(self, r: ReadTxn, target: Checkpoint, paths: list[str] | None,
                 code: bool) -> Prepared:
        """What a restore to target writes: the keys whose value then differs from now."""
        warnings: list[str] = []
        rows: Rows = {}
        left: set[bytes] | None = None  # (a whole restore: what it leaves, delta.rows_near)
        if code and paths is None:
            rows, left = whole_restore(r, target)
        elif code:
            delta = {(TABLE_NAMES[c], key): (value, last)
                     for c, key, value, last in history.values_since(r, target.seq)}
            delta, warnings = self._select(r, target, delta, paths)  # type: ignore[arg-type]  # V is the delta's value type
            for (table, key), (value, last) in delta.items():
                current = r.get(table, key)
                if current != value:
                    rows[(table, key)] = (value, current, last)
            rows = unborn_left(rows)
        rows = dict(sorted(rows.items(), key=index_order))  # (the order the write wants)
        return Prepared(target, next_seq(r), r.count(JOURNAL), rows, warnings, left)

    # -- the file lists of restores -------------------------------------------

    async def complete_restores(self) -> int:
        """List the files each restore added, modified and deleted in its journal record,
        where it was left for later (restore) or a crash came in between. Off the loop,
        then one short transaction per record. Returns how many were listed."""
        done = 0
        while True:
            found = await self._find_restore_files()
            if found is None:
                return done
            seq, files = found
            self.store.write(lambda w: _fill_files(w, seq, files))  # noqa: B023  (called at once)
            done += files is not None

    async def complete_restores_later(self) -> None:
        """complete_restores once the restore has answered (a task without a nursery)."""
        with trio.CancelScope() as scope:
            _listing[id(self.store)] = scope
            try:
                await trio.sleep(LIST_AFTER)
                await self.complete_restores()
            except Exception as e:  # (a system task must not raise; the next restore tries again)
                log.warning("listing the files of a restore failed: %s", e)
            finally:
                if _listing.get(id(self.store)) is scope:
                    del _listing[id(self.store)]

    async def _find_restore_files(self) -> tuple[int, list[FileChange] | None] | None:
        """restore_files where the session runs readings: the mount's reader process (a
        thread's Python holds the GIL the request loop needs), else a worker thread."""
        if (read := self.ctx.elsewhere.read) is None:  # (a context no session holds)
            return await read_off_loop(self.store, self.restore_files)
        return (await read(RESTORE_FILES, None))["found"]  # type: ignore[return-value]  # (plain data)

    def restore_files(self, r: ReadTxn) -> tuple[int, list[FileChange] | None] | None:
        """The oldest restore left without its file list, and that list (None: thinning
        merged its records with others, which list none of its files)."""
        hit = r.seek(META, RESTORE_FILES_KEY)
        if hit is None or not hit[0].startswith(RESTORE_FILES_KEY):
            return None
        lo, hi = from_u64(hit[0][len(RESTORE_FILES_KEY):]), from_u64(hit[1])
        recs = records(r, lo, hi)
        if [(rec.seq, rec.op, rec.paths) for rec in recs] != [(s, "restore", ())
                                                              for s in range(lo, hi)]:
            return lo, None
        after = r if hi == next_seq(r) else AtCheckpoint(r, hi)
        old = {(TABLE_NAMES[t], k): v for rec in recs for t, k, v in rec.undo}
        one_sided = {from_u64(k) for (t, k), v in old.items()
                     if t == NODES and (v is None) != (after.get(NODES, k) is None)}
        return lo, StateDiff(self.ov).file_changes(_Replaced(after, old), after, set(old),
                                                   one_sided, content=False)

    def _mark_before_restore(self, w: WriteTxn, caller: Caller) -> None:
        """Make the checkpoint just before a restore the exact state it replaces."""
        latest = next(self.newest_first(w))
        if latest.seq != next_seq(w) or latest.conv_head != w.meta_int(CONV_HEAD_KEY, 0):
            seq = next_seq(w)
            new_checkpoint(w, seq, seq, "auto", None, "before restore", caller.pid, caller.comm)

    async def _invalidate(self, changed: list[tuple[bytes, bytes, bool]]) -> None:
        """Drop the kernel's caches of the inodes and names changed (key, deleted).

        Not those of the overlay inodes the restore deletes, nor the names in them: no
        name leads there any more, the invalidation of the deleted directory's own name
        drops every name below it from the kernel (d_invalidate prunes the subtree), and
        the restore that brings such an inode back invalidates it then."""
        gone = {from_u64(key) for table, key, deleted in changed
                if table == NODES and deleted and from_u64(key) >= FIRST_UPPER_INO}
        inodes: set[int] = set()
        entries: set[tuple[int, bytes]] = set()
        for table, key, _ in changed:
            ino = from_u64(key[:8])
            if ino in gone:
                continue
            inodes.add(ino)
            if table == DIRENTS:
                entries.add((ino, key[8:]))
        # In-memory hints about lower paths and names stay valid: they describe
        # the immutable lower or are re-learned on the next lookup.
        if inodes or entries:
            await self.ctx.invalidate(sorted(inodes), sorted(entries))

    def _select(self, r: ReadTxn, target: Checkpoint, delta: dict[tuple[bytes, bytes], V],
                paths: list[str]) -> tuple[dict[tuple[bytes, bytes], V], list[str]]:
        """The part of delta that puts only these paths (and what is below them) back."""
        then = AtCheckpoint(r, target.seq)
        keep: set[tuple[bytes, bytes]] = set()
        inos: set[int] = set()
        for path in paths:
            parts = [os.fsencode(p) for p in path.strip("/").split("/") if p not in ("", ".")]
            if not parts or b".." in parts:
                raise UserError(f"bad path {path!r}: give a path inside the mount, without '..'")
            parent_then: int | None = ROOT_INO
            parent_now: int | None = ROOT_INO
            for i, name in enumerate(parts):
                last = i == len(parts) - 1
                ino_then = lookup_or_none(self.ov, then, parent_then, name)
                ino_now = lookup_or_none(self.ov, r, parent_now, name)
                if ino_then is None and ino_now is None:
                    raise UserError(f"{path} exists neither at checkpoint {target.id} nor now")
                for parent in {p for p in (parent_then, parent_now) if p is not None}:
                    keep.add((DIRENTS, u64(parent) + name))
                for ino in (ino_then, ino_now):
                    if ino is not None:
                        keep.add((NODES, u64(ino)))
                        if last:
                            inos.update(self._subtree(then, ino) | self._subtree(r, ino))
                parent_then, parent_now = ino_then, ino_now
                if ino_then is None or ino_now is None:
                    if not last and ino_then is None:
                        break
        selected: dict[tuple[bytes, bytes], V] = {}
        for (table, key), value in delta.items():
            if (table, key) in keep or from_u64(key[:8]) in inos:
                selected[(table, key)] = value
        chosen = {p.strip("/") for p in paths}
        others: set[str] = set()
        spans = []  # the open group (not a checkpoint yet), then the newest groups
        for n, ck in enumerate(self.newest_first(r)):
            if n == 0:
                spans.append((ck.seq, next_seq(r)))
            if ck.seq <= target.seq or n >= WARN_GROUPS:
                break
            if ck.kind != "restore":
                spans.append((ck.start_seq, ck.seq))
        for lo, hi in spans:
            group = {p for rec in records(r, lo, hi) for p in rec.paths}
            if group & chosen:
                others |= group - chosen
        warnings = []
        if others:
            warnings.append("changed together with files not being restored: "
                            + ", ".join(sorted(others)[:10]))
        return selected, warnings

    def _subtree(self, state: Any, ino: int) -> set[int]:
        out = {ino}
        try:
            node = self.ov.node(state, ino)
        except FsError:
            return out
        if node.is_dir:
            out.update(child for _, child, _ in self.ov.walk(state, ino))
        return out

    # -- diff -----------------------------------------------------------------

    def changes(self, r: ReadTxn, a: Checkpoint, b: Checkpoint | None,
                only: list[str] | None = None) -> list[FileChange]:
        """What differs between the trees at a and b (None: live), path by path."""
        sa, sb = self.state(r, a), self.state(r, b)
        lo, hi = sorted((a.seq, b.seq if b else next_seq(r)))
        differ, one_sided = differing(sa.get, sb.get, keys_between(r, lo, hi))
        out = StateDiff(self.ov).file_changes(sa, sb, set(differ), one_sided, content=True)
        if only:
            out = [c for c in out if _under(c.path, only)]
        return out
