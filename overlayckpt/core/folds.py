"""Which automatic checkpoints the default log shows in one row with the one before them:
an agent's own `git commit` that came after its edits' group had closed.

Aider commits each message's edits itself, after asking the model for a commit message:
when that answer takes longer than the window, the edits close as one checkpoint and the
commit (git run by Aider) becomes another. Such a checkpoint folds into the one just
before it when all of these hold:

- both are automatic, and it is the very next checkpoint (a restore, a named checkpoint
  or anything else in between stops the folding);
- it changed git's internals (`groupfiles.is_internal`) and nothing else but bookkeeping
  (paths the repo ignores, agents' own files: core/ignore.py), and what git did there
  was to stage or commit (its summary: `git add`, `git commit`, an index refresh): a
  checkout, reset, merge or branch is a step of its own;
- its command is the one before's, ran under it, or ran under the command the one
  before's ran under (journal._note_under: the pids above a command are known only
  while its group is open): a `git commit` the user types after
  an agent's edit is another process tree and stays a row of its own;
- no conversation line came between them (with hooks, a tool call is a step of its own).

The row shows the newest of them (its id, so restoring or diffing the row reaches the
edits committed) with the older ids in "folded"; `log --all` shows every checkpoint.
Pure reads: any thread.
"""
from __future__ import annotations

from overlayckpt.core import groupfiles
from overlayckpt.core.groupfiles import is_internal
from overlayckpt.core.ignore import Ignored
from overlayckpt.core.summaries import COMMITTING
from overlayckpt.records import Checkpoint, u64
from overlayckpt.store.lmdbstore import ReadTxn
from overlayckpt.tables import META, UNDER_KEY

# A group of more paths than this is not looked at: it is shown.
FOLD_PATHS = 1024


def git_only(r: ReadTxn, ck: Checkpoint, ignored: Ignored) -> bool:
    """Whether ck changed git's internals and, besides them, only bookkeeping; read as far
    as its first path that is neither."""
    n, internal = 0, False
    for path, _ in groupfiles.rows(r, ck):
        n += 1
        if n > FOLD_PATHS:
            return False
        if is_internal(path):
            internal = True
        elif not ignored(path, maybe_dir=True):
            return False
    return internal


def same_tree(r: ReadTxn, ck: Checkpoint, prev: Checkpoint) -> bool:
    """Whether ck's command is prev's, ran under it, or ran under the command prev's ran
    under (prev: the checkpoint just before). journal._note_under marks ck only in the
    last two cases, as its group closes: the mark is the answer."""
    return ck.pid == prev.pid or r.get(META, UNDER_KEY + u64(ck.id)) is not None




def folds_into(r: ReadTxn, ck: Checkpoint, summary: str, prev: Checkpoint | None,
               ignored: Ignored) -> bool:
    """Whether the default log shows ck (whose summary is this) as part of prev, the
    checkpoint just before it."""
    return (prev is not None and ck.kind == "auto" and prev.kind == "auto" and prev.id == ck.id - 1
            and summary.startswith(COMMITTING) and ck.conv_head == prev.conv_head
            and same_tree(r, ck, prev) and git_only(r, ck, ignored))
