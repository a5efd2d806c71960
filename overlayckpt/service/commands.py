"""Session commands on the timeline, answered in the daemon or offline alike.

Each takes its request (messages.py: checked already) and returns its reply, a
JSON-able TypedDict; a user mistake raises UserError with one line to show.
"""
from __future__ import annotations

import base64
import os
import time
from typing import TypedDict, cast

import trio

from overlayckpt.core import groupfiles
from overlayckpt.core.folds import folds_into, git_only
from overlayckpt.core.ignore import Ignored
from overlayckpt.core.journal import Caller
from overlayckpt.core.overlay import make_durable
from overlayckpt.core.patch import render, stat_lines
from overlayckpt.core.summaries import Files, checkpoint_entry, is_internal
from overlayckpt.core.timeline import RESTORE_FILES, Timeline
from overlayckpt.errors import FsError, UserError
from overlayckpt.messages import (
    ApplyReply,
    ApplyRequest,
    BackoutReply,
    BackoutRequest,
    CheckpointReply,
    CheckpointRequest,
    ConversationReply,
    ConversationRequest,
    DiffReply,
    DiffRequest,
    ForkReply,
    ForkRequest,
    ForksReply,
    ForksRequest,
    FsckReply,
    FsckRequest,
    GcReply,
    GcRequest,
    LogEntry,
    LogReply,
    LogRequest,
    RestoreReply,
    RestoreRequest,
    ShownFile,
    ShowReply,
    ShowRequest,
    UnforkReply,
    UnforkRequest,
)
from overlayckpt.records import Checkpoint
from overlayckpt.service.registry import READINGS, command, reading
from overlayckpt.service.session import Session
from overlayckpt.store.lmdbstore import Store
from overlayckpt.store.txn import ReadTxn


def _caller() -> Caller:
    return Caller(os.getpid(), "overlayckpt")


def _paths(paths: list[str] | None) -> list[str] | None:
    """paths as given, each checked: relative to the mount root, without '..'."""
    for p in paths or ():
        if os.path.isabs(p) or ".." in p.split("/"):
            raise UserError(f"path {p!r} must be relative to the mount root and without '..'")
    return paths


@command(CheckpointRequest, durable=lambda cmd: bool(cmd.name))
async def _checkpoint(s: Session, cmd: CheckpointRequest) -> CheckpointReply:
    ck = Timeline(s.ctx).checkpoint(cmd.name, cmd.message, _caller())
    return {"id": ck.id, "name": ck.name, "seq": ck.seq}


# files listed per entry ("files_total" counts them all): a reply stays small however
# many files a checkpoint changed (diff --stat lists them all)
LOG_FILES = 200


@command(LogRequest)
async def _log(s: Session, cmd: LogRequest) -> LogReply:
    """Newest first. Without "all": git's internals are left out of each entry's files and
    checkpoints that changed nothing are left out; "more" says whether "limit" cut the list."""
    Timeline(s.ctx).seal()
    from overlayckpt.store.lmdbstore import parent_of
    parent = s.store.read(parent_of)
    reply = cast(LogReply, await s.read_off_loop(cmd))
    reply["forked_from"] = parent and {"store": parent[0], "checkpoint": parent[1]}
    return reply


def _restore_files_read(s: Session, store: Store, cmd: None) -> dict[str, object]:
    """The next restore's file list, for the daemon to record (Timeline.complete_restores):
    a reading of the daemon's own, which no command names."""
    return {"found": store.read(Timeline(s.ctx).restore_files)}


READINGS[RESTORE_FILES] = _restore_files_read


@reading(LogRequest)
def _log_read(s: Session, store: Store, cmd: LogRequest) -> LogReply:
    tl = Timeline(s.ctx)
    limit, file, everything = cmd.limit, cmd.file, cmd.all

    def fn(r: ReadTxn) -> LogReply:
        out: list[LogEntry] = []
        files_at = Files(s.overlay, r)
        # (bookkeeping rows are folded only in the whole log, not in one file's)
        ignored = None if everything or file is not None else Ignored.of(s.overlay, r)
        folded: list[int] = []  # bookkeeping rows newer than any row shown yet
        git_row: LogEntry | None = None  # an agent's git-only row, folding into the next

        def shown(row: LogEntry) -> bool:
            """row appended, with the bookkeeping rows newer than it; False: limit reached."""
            nonlocal folded
            if limit and len(out) >= limit:
                return False
            if folded:
                row["folded"], folded = folded + row.get("folded", []), []
            out.append(row)
            return True
        newest = tl.newest_first(r)  # (read only as far as shown: the history may be long)
        ck = next(newest, None)
        while ck is not None:
            before = next(newest, None)
            if file is not None and groupfiles.change_of(r, ck, file.strip("/")) is None:
                ck = before
                continue
            entry = checkpoint_entry(r, ck, files_at, LOG_FILES, everything)
            if before is not None and not entry["files_pending"]:
                _by_content(s, r, before, ck, entry, everything)
            skip = entry["empty"] and not everything
            bookkeeping = not skip and ignored is not None and _bookkeeping(r, ck, ignored)
            if git_row is not None:  # ck is the checkpoint it folds into
                if not skip and not bookkeeping and ignored is not None \
                        and folds_into(r, ck, entry["summary"], before, ignored):
                    # (git add, then git commit: the newest git summary names them)
                    _take_place(entry, git_row)
                    entry["summary"], git_row, ck = git_row["summary"], entry, before
                    continue
                if skip or bookkeeping or ignored is None or git_only(r, ck, ignored):
                    # no edits' row to fold into: the git row is one of its own after all
                    if not shown(git_row):
                        return {"checkpoints": out, "more": True}
                    git_row = None
                    if skip or bookkeeping:
                        if bookkeeping:
                            out[-1].setdefault("folded", []).append(ck.id)
                        ck = before
                        continue
                else:
                    _fold_git_row(r, ck, entry, git_row)
                    git_row = None
            elif skip:
                ck = before
                continue
            elif ignored is not None and folds_into(r, ck, entry["summary"], before, ignored):
                git_row, ck = entry, before
                continue
            elif bookkeeping:
                # folded into the row after it (the newer), or the one before if it is the newest
                (out[-1].setdefault("folded", []) if out else folded).append(ck.id)
                ck = before
                continue
            if not shown(entry):
                return {"checkpoints": out, "more": True}
            ck = before
        return {"checkpoints": out, "more": False}
    return store.read(fn)


def _take_place(entry: LogEntry, newer: LogEntry) -> None:
    """entry's row shows newer's checkpoint too, under newer's id: restoring or diffing the
    row reaches the state after both (an agent's edits and its commit: git status clean)."""
    entry["folded"] = [entry["id"], *newer.get("folded", []), *entry.get("folded", [])]
    entry["id"], entry["seq"], entry["time"] = newer["id"], newer["seq"], newer["time"]


def _fold_git_row(r: ReadTxn, ck: Checkpoint, entry: LogEntry, git_row: LogEntry) -> None:
    """entry (ck's row) shows git_row's checkpoint too (core/folds.py), under git_row's id
    (the older ones in "folded"); where ck's summary names only its files, git's summary
    comes before them, as one checkpoint of both would read."""
    from overlayckpt.core.conversation import summary_before
    from overlayckpt.core.summaries import DESCRIBED
    _take_place(entry, git_row)
    if not ck.message and git_row["summary"].startswith("git ") \
            and summary_before(r, ck.start_seq, ck.seq, ck.conv_head) is None:
        git = git_row["summary"]  # (without the files it names after git's part: entry's own)
        while "; " in git and git.rpartition("; ")[2].startswith(DESCRIBED):
            git = git.rpartition("; ")[0]
        files = entry["summary"]  # (after git's own part, e.g. the `git add` of a new file)
        if files.startswith("git "):
            files = files.partition("; ")[2]
        entry["summary"] = f"{git}; {files}" if files else git


# A group of more paths than this is not looked at for bookkeeping: it is shown.
BOOKKEEPING_PATHS = 1024


def _bookkeeping(r: ReadTxn, ck: Checkpoint, ignored: Ignored) -> bool:
    """Whether ck is an automatic checkpoint whose every path is ignored (by the repo's
    rules or as an agent's own file): read as far as its first path that is not."""
    if ck.kind != "auto":
        return False
    n = 0
    for path, _ in groupfiles.rows(r, ck):
        n += 1
        # (a row does not say whether it is a directory: an ignored one is made with its files)
        if n > BOOKKEEPING_PATHS or is_internal(path) or not ignored(path, maybe_dir=True):
            return False
    return n > 0


def _by_content(s: Session, r: ReadTxn, prev: Checkpoint, ck: Checkpoint,
                entry: LogEntry, everything: bool) -> None:
    """Whether ck changed anything, the lines it added and removed, and each file's A/M/D
    from the trees themselves (the journal's "R" of a rename over a new name is an A):
    bounded per row (rowdiff), cached: a checkpoint never changes."""
    from overlayckpt.core.rowdiff import base_of, row_diff
    prev = base_of(r, ck, prev)
    key = (prev.id, ck.id, everything)  # (with or without git's internals)
    found = s.line_counts.get(key)
    if found is None:
        found = s.line_counts[key] = row_diff(s.overlay, r, prev, ck,
                                              [f["path"] for f in entry["files"]])
    if found.empty and ck.kind == "auto":
        entry["empty"] = True
    entry["added"], entry["removed"] = found.added, found.removed
    entry["files"] = [{**f, "change": found.changes.get(f["path"], f["change"])}
                      for f in entry["files"]]


@command(RestoreRequest, sync_soon=True)
async def _restore(s: Session, cmd: RestoreRequest) -> RestoreReply:
    paths = _paths(cmd.paths)
    if paths is not None and cmd.what not in (None, "code"):
        raise UserError("restoring chosen paths restores code only: drop --conversation/--both")
    what = cmd.what or ("code" if paths is not None else "both")
    result = await Timeline(s.ctx).restore(cmd.id, _caller(), paths, what)
    if what in ("conversation", "both"):
        resume = await _claude_resume(s, result["restored"])
        result["warnings"] = result.get("warnings", []) + resume.pop("warnings", [])
        result.update(resume)
    return result


@command(BackoutRequest, durable=True)
async def _backout(s: Session, cmd: BackoutRequest) -> BackoutReply:
    from overlayckpt.core.backout import backout
    return await backout(s.ctx, cmd.id, _caller(), _paths(cmd.paths), cmd.all)


class _Resume(TypedDict, total=False):
    warnings: list[str]
    resume: str
    transcript: str
    claude_resume: str


async def _claude_resume(s: Session, cid: int) -> _Resume:
    """For agent sessions (Claude Code, Codex): a transcript cut back to the checkpoint,
    and the command that resumes it."""
    from overlayckpt.agents.transcripts import resume_command
    from overlayckpt.core.conversation import live_lines
    tl = Timeline(s.ctx)
    lines = s.store.read(lambda r: live_lines(r, tl.get(r, cid).conv_head))
    try:
        # on a worker thread: the transcript path comes from the conversation, which the
        # agent writes, and may lead into the mount (the loop would wait on itself)
        found = await trio.to_thread.run_sync(resume_command, lines, abandon_on_cancel=True)
    except (OSError, ValueError) as e:  # the restore stands; the user learns why in one line
        from overlayckpt.names import quote_path
        why = f"{e.strerror}: {quote_path(e.filename or '')}" if isinstance(e, OSError) else str(e)
        return {"warnings": [f"the agent transcript was not cut: {why}"]}
    if found is None:
        if any(line.get("agent") == "opencode" for line in lines):
            from overlayckpt.agents.opencode import REWIND_NOTE
            return {"warnings": [REWIND_NOTE]}
        return {}
    command, path = found
    out: _Resume = {"resume": command, "transcript": path}
    if command.startswith("claude "):
        out["claude_resume"] = command  # the key cli/timeline.py prints
    return out


@command(ConversationRequest)
async def _conversation(s: Session, cmd: ConversationRequest) -> ConversationReply:
    from overlayckpt.core.conversation import all_lines, live_lines
    tl = Timeline(s.ctx)

    def fn(r: ReadTxn) -> ConversationReply:
        if cmd.all:
            return {"lines": all_lines(r)}
        if cmd.at is not None:
            return {"lines": live_lines(r, tl.get(r, cmd.at).conv_head)}
        return {"lines": live_lines(r)}
    return s.store.read(fn)


@command(DiffRequest)
async def _diff(s: Session, cmd: DiffRequest) -> DiffReply:
    _paths(cmd.paths)
    return cast(DiffReply, await s.read_off_loop(cmd))


@reading(DiffRequest)
def _diff_read(s: Session, store: Store, cmd: DiffRequest) -> DiffReply:
    tl = Timeline(s.ctx)
    paths = _paths(cmd.paths)

    def fn(r: ReadTxn) -> DiffReply:
        # without a: everything since the session started (checkpoint 0); without b: live
        a = tl.get(r, cmd.a if cmd.a is not None else 0)
        b = tl.get(r, cmd.b) if cmd.b is not None else None
        changes = tl.changes(r, a, b, paths)
        if not cmd.all and not paths:  # git's internals only when asked for
            changes = [c for c in changes if not is_internal(c.path)]
        result: DiffReply = {"a": a.id, "b": b.id if b else "live",
                             "files": [{"path": p, "change": c, "added": ad, "removed": rm}
                                       for p, c, ad, rm in stat_lines(changes)]}
        if not cmd.stat:
            result["patch"] = render(changes)
        return result
    return store.read(fn)


@command(ShowRequest)
async def _show(s: Session, cmd: ShowRequest) -> ShowReply:
    return cast(ShowReply, await s.read_off_loop(cmd))


@reading(ShowRequest)
def _show_read(s: Session, store: Store, cmd: ShowRequest) -> ShowReply:
    tl = Timeline(s.ctx)
    path = cmd.path

    def fn(r: ReadTxn) -> ShowReply:
        ck = tl.get(r, cmd.id)
        state = tl.state(r, ck)
        ov = s.overlay
        if path:
            try:
                ino = ov.resolve(state, path)
            except FsError:
                raise UserError(f"{path} does not exist at checkpoint {ck.id}") from None
            node = ov.node(state, ino)
            if node.is_dir:
                names = [os.fsdecode(n) for n, _, _ in ov.entries(state, ino)]
                return {"id": ck.id, "path": path, "type": "dir", "entries": names}
            data = ov.readlink(state, ino, node) if node.is_link else ov.read_all(state, ino, node)
            return {"id": ck.id, "path": path, "type": "symlink" if node.is_link else "file",
                    "mode": node.mode, "content_b64": base64.b64encode(data).decode()}
        files: list[ShownFile] = [
            {"path": p, "type": "dir" if n.is_dir else "symlink" if n.is_link else "file",
             "size": n.size, "mode": n.mode} for p, _, n in ov.walk(state)
            if cmd.all or not is_internal(p)]
        return {"id": ck.id, "files": files}
    return store.read(fn)


@command(ApplyRequest, durable=True, reaches_out=True)
async def _apply(s: Session, cmd: ApplyRequest) -> ApplyReply:
    from overlayckpt.core.apply import apply_checkpoint, apply_live
    try:
        if cmd.checkpoint is not None:
            stats = apply_checkpoint(s.ctx, cmd.checkpoint, cmd.force, cmd.special)
        else:
            stats = apply_live(s.ctx, cmd.force, cmd.special)
    finally:
        s.repo_changed()
    return {"repo": s.repo, **stats}


@command(FsckRequest)
async def _fsck(s: Session, cmd: FsckRequest) -> FsckReply:
    from overlayckpt.core.maintenance import fsck, repair
    if not cmd.repair:  # a plain check changes nothing: off the loop, no sync point
        return cast(FsckReply, await s.read_off_loop(cmd))
    repaired = repair(s.store)  # (a write: on the loop's thread)
    await make_durable(s.store)
    return {**fsck(s.store), "repaired": repaired}


@reading(FsckRequest)
def _fsck_read(s: Session, store: Store, cmd: FsckRequest) -> FsckReply:
    from overlayckpt.core.maintenance import fsck
    return {**fsck(store), "repaired": []}


@command(GcRequest, durable=True, reaches_out=True)
async def _gc(s: Session, cmd: GcRequest) -> GcReply:
    from overlayckpt.core.maintenance import DEFAULT_BUDGET
    budget = DEFAULT_BUDGET if cmd.budget is None else cmd.budget
    return await s.maintain(budget, then_gc=True)


# -- forks (core/fork.py) ---------------------------------------------------------------

@command(ForkRequest, durable=True, reaches_out=True)
async def _fork(s: Session, cmd: ForkRequest) -> ForkReply:
    """A new session's store at "store", starting from checkpoint "id" (none: the live
    state, as a new checkpoint). Its blocks stay here: the fork is recorded first, so no
    gc or thinning between the copy and its end drops what the fork needs."""
    from overlayckpt.core.fork import forget_fork, make_fork, record_fork
    from overlayckpt.core.workers import off_loop
    from overlayckpt.records import iso_time
    from overlayckpt.service.paths import off_mount
    from overlayckpt.store.info import read_info, write_info
    from overlayckpt.store.places import check_store_dir
    path = cmd.store
    if not path:
        raise UserError('fork needs "store" (the new session\'s store directory)')

    def fresh(real: str) -> None:
        if os.path.exists(os.path.join(real, "data.mdb")):
            raise UserError(f"{real} holds a session already: pick another --store")
        check_store_dir(real)
    path, _ = await off_mount(s, path, "the fork's store", fresh)
    tl = Timeline(s.ctx)
    ref = cmd.id
    if ref is None:
        ck = tl.checkpoint(None, "fork", _caller())
    else:
        ck = s.store.read(lambda r: tl.get(r, ref))
    s.store.write(lambda w: record_fork(w, path, ck.id))
    try:
        made = await off_loop(s.store, lambda store: store.read(lambda r: make_fork(r, ck, path)))
    except BaseException:
        s.store.write(lambda w: forget_fork(w, path))
        raise
    info = read_info(s.store.path)
    parent = os.path.realpath(s.store.path)
    fork_info = {"repo": s.repo, "window": info.get("window", 1.0),
                 "block_size": s.store.block_size, "created": iso_time(time.time_ns()),
                 "parent": parent, "parent_checkpoint": ck.id}
    # (on a worker thread, as every use of a path a client gave: see paths.py)
    await trio.to_thread.run_sync(write_info, path, fork_info, abandon_on_cancel=True)
    return {**made, "parent": parent, "repo": s.repo}


@command(UnforkRequest, durable=True, reaches_out=True)
async def _unfork(s: Session, cmd: UnforkRequest) -> UnforkReply:
    """Forget the fork at "store" (it was dropped): its blocks are this session's garbage."""
    from overlayckpt.core.fork import forget_fork
    from overlayckpt.service.paths import off_mount
    from overlayckpt.store.lmdbstore import drop_reader
    path = cmd.store
    if not path:
        raise UserError('unfork needs "store"')
    path, _ = await off_mount(s, path, "the fork's store", drop_reader)
    return {"forgot": s.store.write(lambda w: forget_fork(w, path))}


@command(ForksRequest)
async def _forks(s: Session, cmd: ForksRequest) -> ForksReply:
    """Where this session forked from, and its forks."""
    from overlayckpt.core.fork import fork_info
    return s.store.read(fork_info)
