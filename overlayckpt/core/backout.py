"""Backing out one checkpoint: undo exactly its changes and keep what came after (like
`git revert` or `jj backout`).

For each file checkpoint ID changed (against the checkpoint before it): base is the
file at ID, theirs the file before ID, ours the live file. Ours still base takes
theirs; ours already theirs needs nothing; otherwise the mode and the lines are merged
three ways: each side's hunks against base are kept where the other side left those
lines and the lines next to them alone (git's rule: touching hunks conflict). Any other
difference (a file created, deleted or made a symlink on one side and changed on the
other, a binary file changed on both) is a conflict, and one conflict anywhere changes
nothing: the whole report is raised as one UserError.

The result is written in one write transaction through the overlay's own operations
(overlay.Batch), journaled as one checkpoint of kind "backout" (restored_from: the
checkpoint backed out), after the same exact "before" checkpoint a restore makes, so
restoring that one undoes the backout. It is worked out in a snapshot off the request
loop; the transaction works it out again only if something was written in between.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Any

from overlayckpt.core.context import Context
from overlayckpt.core.history import AtCheckpoint
from overlayckpt.core.journal import Caller, append_closed, close_open_group, next_seq
from overlayckpt.core.overlay import Batch, Mutation
from overlayckpt.core.patch import _is_binary, _opcodes
from overlayckpt.core.summaries import is_internal
from overlayckpt.core.timeline import Timeline
from overlayckpt.core.tree import State
from overlayckpt.core.workers import read_off_loop
from overlayckpt.errors import FsError, UserError
from overlayckpt.messages import BackoutReply, Change, FileChange, Ref
from overlayckpt.records import ROOT_INO, TABLE_NAMES, Checkpoint, from_u64, u64
from overlayckpt.store.txn import ReadTxn, WriteTxn
from overlayckpt.tables import CKPTS

Side = tuple[int, bytes] | None  # (mode, content or link target), as in FileChange; None: no file
Lines = list[bytes]
SHOWN_LINES = 12  # of each side of a conflicting hunk, in the report


# -- merging ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Clash:
    """Lines both sides changed, differently: where they begin in ours (1-based), and the
    lines of each side there."""
    line: int
    ours: Lines
    base: Lines
    theirs: Lines


def _hunks(base: Lines, other: Lines) -> list[tuple[int, int, Lines]]:
    """(lo, hi, lines): base[lo:hi] became lines in other (a near-linear diff: patch.py)."""
    return [(i1, i2, other[j1:j2]) for tag, i1, i2, j1, j2 in _opcodes(base, other)
            if tag != "equal"]


def _patched(base: Lines, lo: int, hi: int, hunks: list[tuple[int, int, int, Lines]]) -> Lines:
    """base[lo:hi] with these hunks (all inside it, in order) applied."""
    out: Lines = []
    pos = lo
    for a, b, _, lines in hunks:
        out += base[pos:a] + lines
        pos = b
    return out + base[pos:hi]


def merge_lines(base: Lines, ours: Lines, theirs: Lines) -> tuple[Lines, list[Clash]]:
    """ours and theirs merged over base, and where they clash (ours kept there)."""
    hunks = sorted([(lo, hi, 0, lines) for lo, hi, lines in _hunks(base, ours)]
                   + [(lo, hi, 1, lines) for lo, hi, lines in _hunks(base, theirs)],
                   key=lambda h: (h[0], h[1]))
    out: Lines = []
    clashes: list[Clash] = []
    pos = shift = i = 0  # shift: ours' line numbers minus base's, before the hunk at i
    while i < len(hunks):
        lo, hi, j = hunks[i][0], hunks[i][1], i + 1
        while j < len(hunks) and hunks[j][0] <= hi:  # overlapping or touching: one region
            hi = max(hi, hunks[j][1])
            j += 1
        group = hunks[i:j]
        mine = _patched(base, lo, hi, [h for h in group if h[2] == 0])
        other = _patched(base, lo, hi, [h for h in group if h[2] == 1])
        out += base[pos:lo]
        if all(h[2] == 1 for h in group):
            out += other
        else:
            out += mine
            if any(h[2] == 1 for h in group) and mine != other:
                clashes.append(Clash(lo + shift + 1, mine, base[lo:hi], other))
        shift += len(mine) - (hi - lo)
        pos, i = hi, j
    return out + base[pos:], clashes


def _what(side: Side) -> str:
    if side is None:
        return "absent"
    mode, data = side
    if stat.S_ISLNK(mode):
        return f"a symlink to {os.fsdecode(data)!r}"
    if stat.S_ISREG(mode):
        return f"a file of {len(data)} bytes, mode {stat.S_IMODE(mode):o}"
    return "a special file"


def _shown(lines: Lines) -> list[str]:
    out = [line.decode("utf-8", "surrogateescape").rstrip("\n") for line in lines[:SHOWN_LINES]]
    if len(lines) > SHOWN_LINES:
        out.append(f"... ({len(lines) - SHOWN_LINES} more lines)")
    return out


def _clash_text(path: str, c: Clash, cid: int) -> str:
    n = len(c.ours)
    where = f"line {c.line}" if n == 1 else f"lines {c.line}-{c.line + n - 1}" if n else \
        f"at line {c.line}"
    return "\n".join([f"{path}: {where}: changed by checkpoint {cid} and again since",
                      "<<<<<<< now", *_shown(c.ours), f"||||||| checkpoint {cid}", *_shown(c.base),
                      "=======", *_shown(c.theirs), f">>>>>>> before checkpoint {cid}"])


def _is_file(side: Side) -> bool:
    return side is not None and stat.S_ISREG(side[0])


def merge_file(path: str, base: Side, theirs: Side, ours: Side, cid: int) -> tuple[Side, list[str]]:
    """What path becomes (ours where nothing is to change), and the report of what keeps it
    from being merged (empty if nothing does)."""
    if ours == base:
        return theirs, []
    if ours == theirs:
        return ours, []
    if not (_is_file(base) and _is_file(theirs) and _is_file(ours)):
        return ours, [f"{path}: checkpoint {cid} changed it from {_what(theirs)} to {_what(base)}, "
                      f"and it is {_what(ours)} now"]
    (bm, bd), (tm, td), (om, od) = base, theirs, ours  # type: ignore[misc]  # each a pair here: None is handled above
    report = []
    if om != bm and tm != bm and om != tm:
        report.append(f"{path}: checkpoint {cid} changed its mode from {stat.S_IMODE(tm):o} to "
                      f"{stat.S_IMODE(bm):o}, and it is {stat.S_IMODE(om):o} now")
    mode = tm if om == bm else om
    if od == bd:
        data = td
    elif od == td or td == bd:
        data = od
    elif _is_binary(bd) or _is_binary(td) or _is_binary(od):
        data = od
        report.append(f"{path}: a binary file, changed by checkpoint {cid} and again since")
    else:
        lines, clashes = merge_lines(bd.splitlines(keepends=True), od.splitlines(keepends=True),
                                     td.splitlines(keepends=True))
        data = b"".join(lines)
        report += [_clash_text(path, c, cid) for c in clashes]
    return (mode, data), report


# -- working it out ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Plan:
    target: Checkpoint  # the checkpoint backed out
    before: Checkpoint  # the one before it
    seq: int  # the journal position it was worked out at
    writes: list[tuple[str, Side, Side]]  # (path, live, what it becomes): only what changes


def _side(tl: Timeline, state: State, path: str) -> Side:
    """A path's file in state, as FileChange has it (a directory is no file: None)."""
    ov = tl.ov
    try:
        ino = ov.resolve(state, path)
        node = ov.node(state, ino)
    except FsError:
        return None
    if node.is_dir:
        return None
    if node.is_link:
        return node.mode, ov.readlink(state, ino, node)
    return node.mode, ov.read_all(state, ino, node) if node.is_reg else b""


def _before(r: ReadTxn, target: Checkpoint) -> Checkpoint:
    """The newest checkpoint of an older state than target's: the one just before it, or
    for a checkpoint with no records of its own (a named one, made after a group), the
    one before that group. (Ids and positions grow together; thinning drops some ids.)"""
    if target.id == 0:
        raise UserError("checkpoint 0 is the session's start: no checkpoint before it "
                        "to back out to")
    for k, v in r.range_from(CKPTS, u64(target.id - 1), reverse=True):
        ck = Checkpoint.unpack(from_u64(k), v)
        if ck.seq < target.seq:
            return ck
    raise UserError(f"checkpoint {target.id} changed no files: nothing to back out")


def work_out(tl: Timeline, r: ReadTxn, ref: Any, paths: list[str] | None,
             everything: bool) -> Plan:
    """What backing out ref writes, in the state r reads; UserError if it cannot."""
    target = tl.get(r, ref)
    before = _before(r, target)
    changes = every = tl.changes(r, before, target, paths)
    if not everything and not paths:  # git's internals only when asked for, as diff has it
        changes = [c for c in changes if not is_internal(c.path)]
    for p in (p.strip("/") for p in paths or ()):
        if not any(c.path == p or c.path.startswith(p + "/") for c in changes):
            raise UserError(f"checkpoint {target.id} did not change {p}: 'overlayckpt log' "
                            "lists what each checkpoint changed")
    if not changes:
        raise UserError(f"checkpoint {target.id} changed only git's internals (.git/...): "
                        "--all backs them out too" if every else
                        f"checkpoint {target.id} changed no files: nothing to back out")
    writes: list[tuple[str, Side, Side]] = []
    report: list[str] = []
    for c in changes:
        ours = _side(tl, r, c.path)
        result, why = merge_file(c.path, c.new, c.old, ours, target.id)
        report += why
        if result != ours:
            writes.append((c.path, ours, result))
    if report:
        raise UserError(f"backing out checkpoint {target.id} conflicts with what changed since; "
                        "nothing was changed:\n" + "\n".join(report)
                        + f"\n(edit those lines first, or back out other paths only: "
                          f"overlayckpt backout {target.id} -- PATH ...)")
    return Plan(target, before, next_seq(r), writes)


# -- writing it -------------------------------------------------------------------------

def _lookup(b: Batch, m: Mutation, parent: int, name: bytes) -> int | None:
    try:
        return b.lookup(m, parent, name)
    except FsError:
        return None


def _owner(b: Batch, m: Mutation, then: State, path: str, parent: int) -> tuple[int, int]:
    """Who owned path before the checkpoint; else who owns the directory it goes in."""
    try:
        node = b.node(then, b.resolve(then, path))
    except FsError:
        node = b.node(m, parent)
    return node.uid, node.gid


def _directory(b: Batch, m: Mutation, then: State, path: str, caller: Caller) -> int:
    """The directory at path, made (as it was before the checkpoint) where it is missing."""
    ino, done = ROOT_INO, ""
    for part in path.split("/") if path else ():
        done = f"{done}/{part}" if done else part
        child = _lookup(b, m, ino, os.fsencode(part))
        if child is None:
            try:
                mode = stat.S_IMODE(b.node(then, b.resolve(then, done)).mode)
            except FsError:
                mode = 0o755
            uid, gid = _owner(b, m, then, done, ino)
            child, _ = b.create(caller, ino, os.fsencode(part), stat.S_IFDIR | mode, uid, gid)
        elif not b.node(m, child).is_dir:
            raise UserError(f"backing out needs {done} to be a directory, and it is a file now; "
                            "nothing was changed")
        ino = child
    return ino


def _remove(b: Batch, m: Mutation, then: State, path: str, caller: Caller) -> None:
    """Remove the file at path, and the directories above it the checkpoint made that it
    leaves empty."""
    while True:
        parent_path, _, name = path.rpartition("/")
        parent = b.resolve(m, parent_path)
        ino = b.lookup(m, parent, os.fsencode(name))
        b.remove(caller, parent, os.fsencode(name), b.node(m, ino).is_dir)
        if not parent_path or not b.is_empty_dir(m, parent) or _exists(b, then, parent_path):
            return
        path = parent_path


def _exists(b: Batch, state: State, path: str) -> bool:
    try:
        b.resolve(state, path)
        return True
    except FsError:
        return False


def _put(b: Batch, m: Mutation, then: State, path: str, result: tuple[int, bytes],
         caller: Caller) -> None:
    """Make path the file result says (its parents too), changing as few blocks as it can."""
    parent_path, _, base = path.rpartition("/")
    parent, name = _directory(b, m, then, parent_path, caller), os.fsencode(base)
    mode, data = result
    ino = _lookup(b, m, parent, name)
    node = b.node(m, ino) if ino is not None else None
    if node is not None and (not node.is_reg or not stat.S_ISREG(mode)):
        if node.is_dir and not b.is_empty_dir(m, ino):  # type: ignore[arg-type]  # node is set: so is ino
            raise UserError(f"backing out makes {path} a file again, and it is a directory with "
                            "files in it now; nothing was changed")
        b.remove(caller, parent, name, node.is_dir)
        node = None
    if node is None:
        uid, gid = _owner(b, m, then, path, parent)
        if not stat.S_ISREG(mode):  # a symlink, or a special file as it was
            rdev = 0 if stat.S_ISLNK(mode) else b.node(then, b.resolve(then, path)).rdev
            b.create(caller, parent, name, mode, uid, gid, rdev,
                     data if stat.S_ISLNK(mode) else None)
            return
        ino, node = b.create(caller, parent, name, mode, uid, gid)
        old = b""
    else:
        old = b.read_all(m, ino, node)  # type: ignore[arg-type]  # node is set: so is ino
    keep, bs = 0, b.bs  # the blocks both begin with stay as they are
    while keep + bs <= min(len(old), len(data)) and old[keep:keep + bs] == data[keep:keep + bs]:
        keep += bs
    if len(data) != len(old):
        b.setattr(caller, ino, size=len(data))  # type: ignore[arg-type]  # ino is set by now
    if data[keep:] != old[keep:]:
        b.write(caller, ino, keep, data[keep:])  # type: ignore[arg-type]  # ino is set by now
    if stat.S_IMODE(node.mode) != stat.S_IMODE(mode):
        b.setattr(caller, ino, mode=mode)  # type: ignore[arg-type]  # ino is set by now


def _write(tl: Timeline, w: WriteTxn, plan: Plan, caller: Caller, paths: list[str] | None,
           everything: bool, changed: list[tuple[bytes, bytes, bool]]
           ) -> tuple[Plan, Checkpoint | None]:
    """The backout's transaction (it may run twice: store.write)."""
    changed.clear()
    if next_seq(w) != plan.seq:  # written since its snapshot: worked out again, here
        plan = work_out(tl, w, plan.target.id, paths, everything)
    if not plan.writes:
        return plan, None
    close_open_group(w)
    tl._mark_before_restore(w, caller)  # restoring the checkpoint before undoes it exactly
    m = Mutation(w)
    b = Batch(tl.ov, m)
    then = AtCheckpoint(w, plan.before.seq)
    for path, _, result in plan.writes:  # removals first: a name may change type
        if result is None:
            _remove(b, m, then, path, caller)
    for path, _, result in plan.writes:
        if result is not None:
            _put(b, m, then, path, result, caller)
    changed += [(TABLE_NAMES[t], key, w.get(TABLE_NAMES[t], key) is None) for t, key, _ in m.undo]
    ck = append_closed(w, caller, "backout", m.undo, "backout", plan.target.id,
                       paths=tuple(m.paths), changes=tuple(m.changes))
    return plan, ck


async def backout(ctx: Context, ref: Ref, caller: Caller, paths: list[str] | None = None,
                  everything: bool = False) -> BackoutReply:
    """Back out checkpoint ref (only these paths, if given) as a new checkpoint; a conflict
    or a mistake raises UserError and changes nothing."""
    tl = Timeline(ctx)
    await ctx.flush_kernel()  # (the kernel's dirty pages are part of what changed since)
    planned = await read_off_loop(ctx.store, lambda r: work_out(tl, r, ref, paths, everything))
    changed: list[tuple[bytes, bytes, bool]] = []
    plan, ck = ctx.store.write(lambda w: _write(tl, w, planned, caller, paths, everything,
                                                changed))
    await tl._invalidate(changed)  # the kernel's caches of what it changed, as a restore does
    files: list[FileChange] = [
        {"path": path, "change": Change.ADDED if ours is None else Change.DELETED if result is None
         else Change.MODIFIED} for path, ours, result in plan.writes]
    return {"id": ck.id if ck else None, "backed_out": plan.target.id, "files": files}
