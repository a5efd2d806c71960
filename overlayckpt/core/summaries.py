"""What a checkpoint shows in the log and in an exported commit: its net file changes
and a one-line summary (from the conversation, the message, git's own record of what
it did, or the files)."""
from __future__ import annotations

from overlayckpt.core import groupfiles
from overlayckpt.core.conversation import summary_before
from overlayckpt.core.groupfiles import is_internal
from overlayckpt.core.history import AtCheckpoint
from overlayckpt.core.tree import Tree
from overlayckpt.errors import FsError
from overlayckpt.messages import Change, FileChange, LogEntry
from overlayckpt.records import Checkpoint, iso_time, u64
from overlayckpt.store.txn import ReadTxn
from overlayckpt.tables import META, RESTORE_FILES_KEY

NO_CHANGES = "no net changes"
REFLOG = ".git/logs/HEAD"
TAIL = 64 * 1024  # of a file git appends to: the newest lines are what a checkpoint added


class Files:
    """Reads a file as it was at a journal position (for git's reflog and messages)."""

    def __init__(self, tree: Tree, r: ReadTxn) -> None:
        self.tree, self.r = tree, r

    def read(self, seq: int, path: str, offset: int = 0, limit: int = TAIL) -> tuple[int, bytes] | None:
        """(size, up to limit bytes from offset) of path at seq; None if not a file there."""
        state = AtCheckpoint(self.r, seq)
        try:
            ino = self.tree.resolve(state, path)
            node = self.tree.node(state, ino)
            if not node.is_reg:
                return None
            return node.size, self.tree.read(state, ino, node, offset, limit)
        except FsError:
            return None


def checkpoint_entry(r: ReadTxn, ck: Checkpoint, files_at: Files | None = None,
                     listed: int | None = None, everything: bool = True) -> LogEntry:
    """files_at: to name git operations from git's own records (without it: from paths).
    "files": the first `listed` (None: all) of its files, git's internals too if
    everything; "files_total": how many there are."""
    counts = groupfiles.counts(r, ck)
    work_n = {change: n[0] for change, n in counts.items() if n[0]}
    total = sum(n[0] + n[1] for n in counts.values())
    shown_n = total if everything else sum(work_n.values())
    files, work, internal = _read_rows(r, ck, work_n, total - sum(work_n.values()),
                                       shown_n if listed is None else min(listed, shown_n),
                                       everything)
    # a restore lists its files just after its answer (timeline.complete_restores)
    pending = ck.kind == "restore" and r.get(META, RESTORE_FILES_KEY + u64(ck.start_seq)) is not None
    summary = (summary_before(r, ck.start_seq, ck.seq, ck.conv_head)
               if ck.kind not in ("restore", "backout") else None)
    if ck.kind == "restore":
        summary = f"restored checkpoint {ck.restored_from}"
    elif ck.kind == "backout":  # (restored_from: the checkpoint it backed out)
        summary = f"backed out checkpoint {ck.restored_from}"
    empty = not total and not summary and not ck.message and ck.id != 0
    if not summary:
        summary = (ck.message or git_summary(ck, internal, work, work_n, files_at)
                   or describe(work, work_n) or ("session start" if ck.id == 0 else NO_CHANGES))
    return {
        "id": ck.id, "seq": ck.seq, "time": iso_time(ck.time_ns), "kind": ck.kind, "name": ck.name,
        "message": ck.message, "summary": summary, "files": files, "files_total": shown_n,
        "empty": empty and ck.kind == "auto", "process": {"pid": ck.pid, "comm": ck.comm},
        "restored_from": ck.restored_from, "files_pending": pending,
    }


def _read_rows(r: ReadTxn, ck: Checkpoint, work_n: dict[str, int], internal_n: int, shown_n: int,
               everything: bool) -> tuple[list[FileChange], list[FileChange], dict[str, str]]:
    """(the files shown, the work tree's files read, every internal path's change), reading
    ck's rows only as far as these and describe's first names of each change need."""
    files: list[FileChange] = []
    work: list[FileChange] = []
    internal: dict[str, str] = {}
    names_left = sum(min(3, n) for n in work_n.values())
    named: dict[str, int] = {}
    for path, change in groupfiles.rows(r, ck):
        if len(files) >= shown_n and not names_left and len(internal) >= internal_n:
            break
        f: FileChange = {"path": path, "change": change}
        inside = is_internal(path)
        if inside:
            internal[path] = change
        else:
            named[change] = named.get(change, 0) + 1
            if named[change] <= 3:
                names_left -= 1
                work.append(f)
        if len(files) < shown_n and (everything or not inside):
            files.append(f)
    return files, work, internal


def git_summary(ck: Checkpoint, internal: dict[str, str], work: list[FileChange],
                work_n: dict[str, int], files_at: Files | None) -> str | None:
    """What git did, when a checkpoint changed .git: `git commit "subject"`, `git checkout
    main`..., then what it did to the work tree (work: its first files, work_n: how many
    of each change). (The journal has no command lines: the reflog git appends to names
    each move of HEAD; the paths name the rest.)"""
    if not internal:
        return None
    moves = _reflog_lines(ck, files_at) if REFLOG in internal and files_at else []
    what = _from_reflog(moves, internal, bool(work)) if moves else _from_paths(ck, internal, files_at)
    return what + (f"; {describe(work, work_n)}" if work else "")


def _reflog_lines(ck: Checkpoint, files_at: Files) -> list[str]:
    before = files_at.read(ck.start_seq, REFLOG, limit=0)
    start = before[0] if before else 0
    after = files_at.read(ck.seq, REFLOG, start)
    if after is None:
        return []
    lines = after[1].decode(errors="replace").splitlines()
    return [line.partition("\t")[2] for line in lines if "\t" in line]


def _new_branches(internal: dict[str, str]) -> list[str]:
    # git creates a branch's reflog with it (its ref file arrives by a rename: "R")
    prefix = ".git/logs/refs/heads/"
    return [p[len(prefix):] for p, c in internal.items() if p.startswith(prefix) and c == Change.ADDED]


# The summaries git_summary gives what stages or commits the work tree (an index refresh
# too), as opposed to a checkout, reset, merge or branch: core/folds.py folds only these.
COMMITTING = ("git add", "git commit", "git: index updated")


def _from_reflog(moves: list[str], internal: dict[str, str], work_changed: bool) -> str:
    first, last = moves[0], moves[-1]
    verb = first.split(":")[0].split(" ")[0]  # "commit (amend): x" -> commit
    if verb == "commit":
        subjects = [m.partition(": ")[2] for m in moves if m.startswith("commit")]
        amend = " --amend" if last.startswith("commit (amend)") else ""
        more = f" (and {len(subjects) - 1} more)" if len(subjects) > 1 else ""
        return f'git commit{amend} "{subjects[-1]}"{more}'
    if verb == "checkout" and " to " in last:
        to = last.rpartition(" to ")[2]
        return f"git checkout{' -b' if to in _new_branches(internal) else ''} {to}"
    if verb == "reset":
        target = last.partition("moving to ")[2] or "HEAD"
        return f"git reset{' --hard' if work_changed else ''} {target}"
    if verb == "merge":
        return f"git merge {first.split(':')[0].split(' ', 1)[-1]}"
    return f"git {verb}"


def _from_paths(ck: Checkpoint, internal: dict[str, str], files_at: Files | None) -> str:
    if ".git/COMMIT_EDITMSG" in internal:  # a commit git logged no move for
        msg = files_at.read(ck.seq, ".git/COMMIT_EDITMSG", limit=200) if files_at else None
        subject = msg[1].decode(errors="replace").strip().split("\n")[0] if msg else ""
        return f'git commit "{subject}"' if subject else "git commit"
    if internal.get(".git/HEAD") == Change.ADDED:
        return "git init"
    branches = _new_branches(internal)
    if branches:
        return f"git branch {' '.join(branches)}"
    heads = [p for p in internal if p.startswith((".git/refs/", ".git/logs/refs/"))]
    if any("refs/stash" in p for p in heads):
        return "git stash"
    tags = sorted({p.rpartition("/")[2] for p in heads if "/refs/tags/" in f"/{p}"})
    if tags:
        return f"git tag {' '.join(tags)}"
    if ".git/FETCH_HEAD" in internal:
        return "git fetch"
    if any(p.startswith(".git/objects/") for p in internal) and ".git/index" in internal:
        return "git add"
    if set(internal) == {".git/index"}:
        return "git: index updated"
    return f"git: {describe([{'path': p, 'change': c} for p, c in internal.items()])}"


_WORDS: dict[str, str] = {Change.ADDED: "added", Change.MODIFIED: "modified",
                          Change.DELETED: "deleted", Change.RENAMED: "renamed"}
# how each part of describe's text begins ("modified a.py, b.py")
DESCRIBED = tuple(f"{word} " for word in _WORDS.values())


def describe(files: list[FileChange], totals: dict[str, int] | None = None) -> str:
    """totals: how many files of each change there are, when files holds only the first
    three of each (else files is all of them)."""
    words = _WORDS
    by: dict[str, list[str]] = {}  # the first 3 names of each kind
    counts: dict[str, int] = {}
    for f in files:
        verb = words.get(f["change"], "changed")
        counts[verb] = counts.get(verb, 0) + 1
        if counts[verb] <= 3:
            by.setdefault(verb, []).append(f["path"].rpartition("/")[2])
    if totals is not None:
        counts = {}
        for change, n in totals.items():
            verb = words.get(change, "changed")
            counts[verb] = counts.get(verb, 0) + n
    parts = []
    for verb, names in by.items():
        more = counts[verb] - len(names)
        parts.append(f"{verb} {', '.join(names)}" + (f" and {more} more" if more else ""))
    return "; ".join(parts)
