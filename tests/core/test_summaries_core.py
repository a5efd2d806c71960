"""What the log shows: git's work named as git commands, git's internals and no-op
checkpoints left out unless asked for, pages. In process, over a real store; the same
with the real git in a mount is tests/test_git_timeline.py."""
from __future__ import annotations

import json

from overlayckpt.core.conversation import append
from overlayckpt.core.groupfiles import GONE, fold
from overlayckpt.core.ignore import AGENT_RULES, Ignored
from overlayckpt.core.journal import Caller
from overlayckpt.core.summaries import describe, is_internal
from overlayckpt.core.timeline import Timeline
from overlayckpt.messages import FileChange
from overlayckpt.records import ROOT_INO
from overlayckpt.service.session import Session

from .helpers_core import ME, OTHER, ino, put

GIT = Caller(5151, "git")
OLD, NEW = "1" * 40, "2" * 40


def reflog(message: str) -> bytes:
    return f"{OLD} {NEW} t <t@t> 1796131919 +0000\t{message}\n".encode()


async def log(s: Session, **cmd: object) -> dict:
    return await s.command({"cmd": "log", **cmd})


def test_internal_paths_are_those_in_a_git_directory() -> None:
    assert is_internal(".git/HEAD") and is_internal("vendor/lib/.git/index") and is_internal(".git")
    assert not is_internal(".gitignore") and not is_internal("src/git/x.py")


def test_fold_and_describe_net_changes() -> None:
    net: dict[str, str] = {}
    for paths, changes in ((("t.tmp",), ("A",)), (("a.py", "t.tmp"), ("R", "<")), (("b.py",), ("D",))):
        for path, change in zip(paths, changes):
            net[path] = fold(net.get(path), change)
    files: list[FileChange] = [{"path": p, "change": c} for p, c in sorted(net.items()) if c != GONE]
    assert files == [{"path": "a.py", "change": "R"}, {"path": "b.py", "change": "D"}]
    assert describe(files) == "renamed a.py; deleted b.py"


async def test_a_git_commit_reads_as_the_command_with_its_subject(session: Session) -> None:
    ov = session.overlay
    put(ov, ME, ".git/logs/HEAD", reflog("commit (initial): init"))
    put(ov, ME, "README.md", b"edited\n")
    await log(session)  # seals: the agent's edit is a checkpoint of its own
    put(ov, GIT, ".git/objects/ab/cdef0123", b"\x78\x01blob")
    put(ov, GIT, ".git/index", b"DIRC new")
    put(ov, GIT, ".git/COMMIT_EDITMSG", b"hash passwords\n")
    put(ov, GIT, ".git/logs/HEAD", reflog("commit: hash passwords"), append=True)
    reply = await log(session)
    newest = reply["checkpoints"][0]
    assert newest["summary"] == 'git commit "hash passwords"'
    assert newest["files"] == [] and newest["process"]["comm"] == "git"
    everything = (await log(session, all=True))["checkpoints"][0]
    assert {f["path"] for f in everything["files"]} >= {".git/index", ".git/COMMIT_EDITMSG"}


async def test_checkout_and_reset_name_the_branch_and_the_work_tree_change(session: Session) -> None:
    ov = session.overlay
    put(ov, ME, ".git/logs/HEAD", reflog("commit (initial): init"))
    await log(session)
    put(ov, GIT, ".git/HEAD", b"ref: refs/heads/feat\n")
    put(ov, GIT, ".git/logs/refs/heads/feat", reflog("branch: Created from HEAD"))
    put(ov, GIT, ".git/logs/HEAD", reflog("checkout: moving from main to feat"), append=True)
    assert (await log(session))["checkpoints"][0]["summary"] == "git checkout -b feat"
    put(ov, OTHER, "README.md", b"a change to throw away\n")
    put(ov, GIT, "README.md", b"# demo\n\nhello\n")
    put(ov, GIT, ".git/ORIG_HEAD", NEW.encode())
    put(ov, GIT, ".git/logs/HEAD", reflog("reset: moving to HEAD"), append=True)
    newest = (await log(session))["checkpoints"][0]
    assert newest["summary"] == "git reset --hard HEAD; modified README.md"
    assert newest["files"] == [{"path": "README.md", "change": "M"}]


async def test_without_a_reflog_move_the_paths_name_the_operation(session: Session) -> None:
    ov = session.overlay
    put(ov, GIT, ".git/objects/ab/cdef0123", b"\x78\x01blob")
    put(ov, GIT, ".git/index", b"DIRC new")
    assert (await log(session))["checkpoints"][0]["summary"] == "git add"
    put(ov, GIT, ".git/index", b"DIRC refreshed")
    assert (await log(session))["checkpoints"][0]["summary"] == "git: index updated"


async def test_no_op_checkpoints_are_hidden_unless_all(session: Session) -> None:
    ov = session.overlay
    put(ov, ME, "scratch.tmp", b"x")
    ov.remove(ME, ROOT_INO, b"scratch.tmp", False)
    await log(session)
    put(ov, OTHER, "README.md", b"real\n")
    shown = (await log(session))["checkpoints"]
    assert [c["summary"] for c in shown] == ["modified README.md", "session start"]
    everything = (await log(session, all=True))["checkpoints"]
    assert [c["summary"] for c in everything] == ["modified README.md", "no net changes", "session start"]


async def test_a_limited_log_says_there_is_more(session: Session) -> None:
    ov = session.overlay
    for i in range(5):
        put(ov, Caller(6000 + i, "sed"), f"f{i}.txt", b"x")
    page = await log(session, limit=3)
    assert [c["summary"] for c in page["checkpoints"]] == ["added f4.txt", "added f3.txt", "added f2.txt"]
    assert page["more"] is True
    rest = await log(session, limit=10)
    assert len(rest["checkpoints"]) == 6 and rest["more"] is False


async def test_diff_and_show_leave_git_internals_out_unless_asked(session: Session) -> None:
    ov = session.overlay
    put(ov, GIT, ".git/index", b"DIRC new")
    put(ov, GIT, "notes.txt", b"by git\n")
    Timeline(session.ctx).checkpoint("after", None, ME)
    stat_only = await session.command({"cmd": "diff", "b": "after", "stat": True})
    assert [f["path"] for f in stat_only["files"]] == ["notes.txt"]
    both = await session.command({"cmd": "diff", "b": "after", "stat": True, "all": True})
    assert [f["path"] for f in both["files"]] == [".git/index", "notes.txt"]
    asked = await session.command({"cmd": "diff", "b": "after", "paths": [".git"]})
    assert ".git/index" in asked["patch"]
    shown = await session.command({"cmd": "show", "id": "after"})
    assert not any(is_internal(f["path"]) for f in shown["files"])
    shown_all = await session.command({"cmd": "show", "id": "after", "all": True})
    assert ".git/index" in {f["path"] for f in shown_all["files"]}


async def test_an_entry_of_many_files_reads_its_first_rows_and_shows_what_all_of_them_say(
        session: Session) -> None:
    """The log lists the first LOG_FILES of an entry's files and counts and names them all
    from its counts row: the same entry as reading every row gives (with and without git's
    internals, and the --file filter by one row)."""
    from overlayckpt.core import groupfiles
    from overlayckpt.service.commands import LOG_FILES
    ov = session.overlay
    for i in range(LOG_FILES + 40):
        put(ov, ME, f"a/f{i:03d}.txt", b"x")
    for i in range(3):
        put(ov, ME, f".git/objects/{i:02d}", b"o")
    put(ov, ME, "docs/guide.txt", b"changed")  # the one M, after the first LOG_FILES names
    put(ov, ME, "zz/late.txt", b"y")
    ov.remove(ME, ino(ov, "a"), b"f001.txt", False)
    put(ov, ME, "a/f001.txt", b"again")  # deleted and made again: still A
    put(ov, ME, "tmp.txt", b"t")
    ov.remove(ME, ROOT_INO, b"tmp.txt", False)  # made and removed: gone, not counted
    put(ov, OTHER, "README.md", b"other group")
    Timeline(session.ctx).seal()
    ck = session.store.read(lambda r: Timeline(session.ctx).get(r, 1))
    every = session.store.read(lambda r: groupfiles.files(r, ck))
    work = [f for f in every if not is_internal(f["path"])]
    internal = [f for f in every if is_internal(f["path"])]
    assert len(work) > LOG_FILES + 40 and len(internal) == 5 and work[-1]["path"] == "zz/late.txt"
    want = f"git: {describe(internal)}; {describe(work)}"
    for flags, shown in (({}, work), ({"all": True}, every)):
        entry = next(e for e in (await log(session, **flags))["checkpoints"] if e["id"] == 1)
        assert (entry["files"], entry["files_total"], entry["summary"]) == (
            shown[:LOG_FILES], len(shown), want)
    for path, listed in (("zz/late.txt", True), ("tmp.txt", False), (".git/objects/01", True)):
        found = [e["id"] for e in (await log(session, file=path))["checkpoints"]]
        assert (1 in found) == listed, path


def _line(s: Session, **obj: object) -> None:
    s.conversation_append(json.dumps({"content": "", **obj}).encode())


async def test_after_a_restore_summaries_come_from_the_live_branch_only(session: Session) -> None:
    """Issue 34: the lines a restore --both abandoned chain from the head it moved back
    to; the next checkpoint's summary must not be taken from them."""
    ov = session.overlay
    put(ov, GIT, ".git/index", b"DIRC")
    _line(session, role="user", content="edit the readme")
    await log(session)
    before = (await log(session, all=True))["checkpoints"][0]["id"]
    _line(session, role="assistant", tool="Edit", event="PreToolUse", content="README.md")
    put(ov, ME, "README.md", b"step 0\n")
    _line(session, role="tool", event="PostToolUse", content="ok")
    _line(session, role="assistant", event="Stop", content="Step 0.")
    assert (await log(session))["checkpoints"][0]["summary"] == "Edit: README.md"
    await session.command({"cmd": "restore", "id": before, "what": "both"})
    put(ov, GIT, ".git/index", b"DIRC refreshed")
    newest = (await log(session, all=True))["checkpoints"][0]
    assert newest["summary"] == "git: index updated"
    # a turn on the live branch after the restore still names its checkpoint
    put(ov, ME, "notes.txt", b"new\n")
    _line(session, role="assistant", event="Stop", content="Wrote the notes.")
    assert (await log(session))["checkpoints"][0]["summary"] == "Wrote the notes."


async def test_checkpoints_that_change_no_content_are_hidden_unless_all(session: Session) -> None:
    """Issue 34: a `touch` (mtime only), a file rewritten with the same bytes, a temp file
    made and removed, and a git index rewritten as it was are each a checkpoint of their
    own, listed only with all (and marked empty); a chmod is a change."""
    ov = session.overlay
    put(ov, GIT, ".git/index", b"DIRC same")
    await log(session)
    readme = ino(ov, "README.md")
    ov.setattr(Caller(7001, "touch"), readme, mtime_ns=123_000_000_000)
    await log(session)
    put(ov, Caller(7002, "cp"), "README.md", ov.live(lambda r: ov.read_all(r, readme)))
    await log(session)
    put(ov, Caller(7003, "git"), ".git/index", b"DIRC same")
    await log(session)
    put(ov, Caller(7004, "agent"), "t.tmp", b"x")
    ov.remove(Caller(7004, "agent"), ROOT_INO, b"t.tmp", False)
    await log(session)
    ov.setattr(Caller(7005, "chmod"), ino(ov, "run.sh"), mode=0o100700)
    put(ov, Caller(7006, "sed"), "README.md", b"one\ntwo\n")
    shown = (await log(session))["checkpoints"]
    assert [c["process"]["comm"] for c in shown] == ["sed", "chmod", "git", ""]
    assert not any(c["empty"] for c in shown)
    everything = (await log(session, all=True))["checkpoints"]
    assert [(c["process"]["comm"], c["empty"]) for c in everything] == [
        ("sed", False), ("chmod", False), ("agent", True), ("git", True), ("cp", True),
        ("touch", True), ("git", False), ("", False)]


async def test_every_listed_row_counts_its_lines(session: Session) -> None:
    ov = session.overlay
    for i in range(30):
        put(ov, Caller(8000 + i, "sed"), f"f{i}.txt", b"x\n" * (i + 1))
    put(ov, Caller(8100, "sed"), "f0.txt", b"y\nx\n")
    rows = (await log(session, limit=40))["checkpoints"]
    assert len(rows) == 32
    assert (rows[0]["added"], rows[0]["removed"]) == (1, 0)
    assert [(c["added"], c["removed"]) for c in rows[1:31]] == [(i + 1, 0) for i in reversed(range(30))]
    assert [f["change"] for f in rows[1]["files"]] == ["A"]


def test_the_ignore_rules_follow_gitignore() -> None:
    ignored = Ignored([*AGENT_RULES, "build/", "/top.txt", "*.log", "!keep.log", "docs/**/*.tmp",
                       "# a comment", ""])
    assert ignored("build/x.o") and ignored("src/build/y.o") and not ignored("build")
    assert ignored("top.txt") and not ignored("src/top.txt")
    assert ignored("a/b.log") and not ignored("a/keep.log")
    assert ignored("docs/x.tmp") and ignored("docs/a/b/x.tmp") and not ignored("x.tmp")
    assert ignored(".aider.chat.history.md") and ignored(".aider.tags.cache.v4/cache.db-wal")
    assert ignored("pkg/__pycache__/m.cpython-311.pyc") and not ignored("src/app.py")


async def test_bookkeeping_checkpoints_fold_into_their_neighbour(session: Session) -> None:
    """Issue 34: a checkpoint whose every path the repo ignores (or is an agent's own file)
    is no row of its own in the default log: the row after it lists its id."""
    ov = session.overlay
    put(ov, ME, ".gitignore", b"build/\n")
    await log(session)
    put(ov, Caller(9001, "aider"), ".aider.chat.history.md", b"# chat\n")
    await log(session)
    put(ov, Caller(9002, "aider"), "app.py", b"print(1)\n")
    await log(session)
    put(ov, Caller(9003, "make"), "build/app.o", b"\x7fELF")
    put(ov, Caller(9003, "make"), "build/app", b"\x7fELF")
    shown = (await log(session))["checkpoints"]
    assert [(c["summary"], c.get("folded")) for c in shown] == [
        ("added app.py", [4, 2]), ("added .gitignore", None), ("session start", None)]
    everything = (await log(session, all=True))["checkpoints"]
    assert [c["id"] for c in everything] == [4, 3, 2, 1, 0]


AIDER = Caller(6161, "aider")


async def test_an_agents_own_git_commit_folds_into_its_edits(session: Session) -> None:
    """An agent's `git commit` after its edits' group closed (Aider's, when the model takes
    longer than the window to write the commit message) is no row of its own in the default
    log: git run by the agent itself, or under it (git add, then git commit), and the edits
    are one row, named by the commit, under the commit's id; `log --all` shows each."""
    ov = session.overlay
    put(ov, ME, ".gitignore", b".aider*\n")
    await log(session)
    put(ov, AIDER, "README.md", b"shout\n")
    put(ov, AIDER, ".aider.chat.history.md", b"# chat\n")
    await log(session)  # the window passed: the edits close
    put(ov, AIDER, ".git/objects/ab/cdef0123", b"\x78\x01blob")
    put(ov, AIDER, ".git/COMMIT_EDITMSG", b"shout the greeting\n")
    put(ov, AIDER, ".aider.chat.history.md", b"# chat\nmore\n")  # its own files fold too
    shown = (await log(session))["checkpoints"]
    assert [(c["summary"], len(c.get("folded", []))) for c in shown] == [
        ('git commit "shout the greeting"; added .aider.chat.history.md; modified README.md', 1),
        ("added .gitignore", 0),
        ("session start", 0)], shown
    # the row is the commit's checkpoint (restoring it gives the edits committed), the
    # edits' checkpoint folded into it
    edits = shown[0]["folded"][0]
    assert shown[0]["folded"] == [edits] and shown[0]["id"] == edits + 1
    # git as the agent's child, a command of its own (an agent run at a shell prompt):
    # git add, then git commit, each a checkpoint
    put(ov, AIDER, "notes.txt", b"n\n")
    await log(session)
    put(ov, Caller(7001, "git", above=(6161, 1)), ".git/index", b"DIRC 2")
    await log(session)
    put(ov, Caller(7002, "git", above=(6161, 1)), ".git/COMMIT_EDITMSG", b"add notes\n")
    shown = (await log(session))["checkpoints"]
    assert shown[0]["summary"] == 'git commit "add notes"; added notes.txt', shown[0]
    assert shown[0]["id"] == edits + 4 and sorted(shown[0]["folded"]) == [edits + 2, edits + 3], shown[0]
    assert shown[1]["id"] == edits + 1
    everything = (await log(session, all=True))["checkpoints"]
    assert [c["id"] for c in everything][:3] == [edits + 4, edits + 3, edits + 2]


async def test_an_agents_checkout_or_reset_stays_a_row(session: Session) -> None:
    """Only staging and committing fold: a checkout, branch or reset the agent (or a script
    that also edits) runs is a step of its own, even right after its edits."""
    ov = session.overlay
    put(ov, AIDER, "README.md", b"shout\n")
    await log(session)
    put(ov, AIDER, ".git/logs/HEAD", reflog("checkout: moving from main to feat"), append=True)
    put(ov, AIDER, ".git/refs/heads/feat", b"0" * 40 + b"\n")
    await log(session)
    put(ov, AIDER, ".git/logs/HEAD", reflog("reset: moving to HEAD"), append=True)
    shown = (await log(session))["checkpoints"]
    assert [c["summary"] for c in shown][:3] == [
        "git reset HEAD", "git checkout feat", "modified README.md"], shown
    assert not any(c.get("folded") for c in shown)


async def test_a_git_commit_of_another_process_or_after_a_step_stays_a_row(session: Session) -> None:
    """A `git commit` the user types after an agent's edit (another process tree), one after
    a named checkpoint or a restore, and one after a conversation line are rows of their own."""
    ov = session.overlay
    tl = Timeline(session.ctx)
    put(ov, AIDER, "README.md", b"shout\n")
    await log(session)
    put(ov, Caller(8001, "git", above=(8000, 1)), ".git/COMMIT_EDITMSG", b"mine\n")  # the user's
    await log(session)
    put(ov, AIDER, "a.txt", b"a\n")
    await log(session)
    tl.checkpoint("named", None, ME)
    put(ov, AIDER, ".git/COMMIT_EDITMSG", b"after named\n")
    await log(session)
    put(ov, AIDER, "b.txt", b"b\n")
    await log(session)
    session.store.write(lambda w: append(w, {"role": "assistant", "content": "next step"}))
    put(ov, AIDER, ".git/COMMIT_EDITMSG", b"after a line\n")
    shown = (await log(session))["checkpoints"]
    assert [c["summary"] for c in shown][:6] == [
        "next step", "added b.txt", 'git commit "after named"', "no net changes", "added a.txt",
        'git commit "mine"'], [(c["id"], c["summary"]) for c in shown]
    assert not any(c.get("folded") for c in shown)
