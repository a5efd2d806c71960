"""Checkpoints as git commits (export git) and session bundles (export bundle / import).

export git
    Every checkpoint, in id order, becomes one commit on a branch of the repo
    (default `overlayckpt/<session>`, session = the store directory's name).
    The commit's tree is exactly the checkpoint's tree minus anything inside a
    `.git` (the agent's own git operations show up there; nested repositories'
    work-tree files are exported as plain files). Its message carries the
    checkpoint's summary, a `Checkpoint-Id:` trailer and friends, and the
    conversation lines that arrived since the previous checkpoint.

    Git is driven through plumbing that never reads or writes the repo's
    index, HEAD, work tree, stash or other branches: one `git fast-import`
    per export call builds the commits and moves only our branch (it refuses
    a non-fast-forward, so a concurrent export cannot lose commits). Its
    trees live in its memory and each commit lists only the paths that
    changed (`Timeline.changes` between consecutive checkpoints), so the cost
    of a checkpoint is what changed in it, not the size of the repo. (A
    temporary index with update-index/write-tree would read and write every
    index entry per checkpoint and spawn 4-5 processes each.) Only the first
    commit of a new branch is a full tree: the checkpoint it starts from,
    with the repo's HEAD at that checkpoint as its parent; blobs the repo
    already has are referenced, not written again.

    Which checkpoint a commit is comes from its `Checkpoint-Id:` trailer, so
    the branch itself is the export's state: a second export adds nothing,
    a later one only the new checkpoints, and `Overlayckpt-Origin:` (the time
    of checkpoint 0) keeps another session's history from being continued.

    Git runs on the repo's real `.git` reached through the lower directory fd
    (`/proc/<pid>/fd/<fd>/.git`), which works under an in-place mount without
    going through the mount: the daemon never waits on itself. `--bare` keeps
    git from resolving a work tree (whose path would lead into the mount).

export bundle / import
    A bundle is one zstd stream of msgpack objects: a header (format,
    block size, repo, the lower inodes the session refers to with their
    paths, type, size and content digest), then `[table, key, value]` for
    every entry of every table of the store, then a trailer with the counts.
    `import` loads it into a new, empty store, verifying every block's digest.

    Lower entries are numbered by the repo's own st_ino, so another checkout
    of the repo (another machine, a `cp -a`) numbers them differently. Import
    looks each recorded path up in the target repo, refuses it if a file is
    missing or differs (pinned paths excepted: the store keeps those), and
    rewrites every lower inode in the entries it loads (`_Remap`). Over the
    recorded directory itself (same inodes) nothing is hashed or rewritten.
    Only the entries the session refers to are checked, not the whole tree.

Concurrency: in the daemon, reading the store and the tree runs on the trio
thread in synchronous steps (a read transaction may stay open across awaits,
never a write transaction); git runs as an async subprocess, so the mount
keeps serving meanwhile. The bundle writer reads only raw tables, in a
thread of its own.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import blake3
import msgpack
import trio
import zstandard

from .apply import seen_fingerprint
from .errors import FsError, UserError
from .lower import lstat_beneath, openat2_beneath
from .records import (
    FIRST_UPPER_INO, FORMAT_VERSION, LOWER_INO_ONE, ROOT_INO, T_NODES, TABLE_NAMES, WHITEOUT,
    Checkpoint, JournalRecord, Node, from_u64, iso_time, lower_ino, pack_obj, u64, unpack_obj,
)
from .session import Session, command, default_store_dir, read_info, write_info
from .store import TABLES, ReadTxn, Store

if TYPE_CHECKING:
    from .timeline import Timeline

log = logging.getLogger(__name__)

CHUNK = 50  # checkpoints per export call from the CLI: progress granularity
IDENT = "overlayckpt <overlayckpt@localhost>"
CONV_LINES = 200  # conversation lines kept in one commit message
CONV_CHARS = 1000  # characters kept of one conversation line
_YIELD_EVERY = 256  # tree entries between two chances for the daemon to serve FUSE

# Environment variables that would point git at another repository or object store.
_GIT_LOCATION_ENV = (
    "GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_NAMESPACE", "GIT_CEILING_DIRECTORIES", "GIT_PREFIX",
    "GIT_DISCOVERY_ACROSS_FILESYSTEM", "GIT_QUARANTINE_PATH", "GIT_SHALLOW_FILE", "GIT_GRAFT_FILE",
    "GIT_REPLACE_REF_BASE", "GIT_NO_REPLACE_OBJECTS",
)
# Settings that could make plumbing run user code, prompt, or write beside the objects.
# fastimport.unpackLimit=0: always write one pack into .git/objects/pack, never loose
# objects: in an in-place session the overlay may hold .git/objects/XX directories of its
# own, which would hide loose objects written behind it into the repo's.
_GIT_CONFIG = ("core.hooksPath=/dev/null", "core.fsmonitor=false", "gc.auto=0",
               "core.splitIndex=false", "maintenance.auto=false", "fastimport.unpackLimit=0")


# -- paths and modes ------------------------------------------------------------

def git_name_ok(name: bytes) -> bool:
    """Whether a path component may go into a git tree: never `.git` or an alias of it
    (git refuses them on checkout: case-insensitive, NTFS trailing dots/spaces, 8.3 name)."""
    low = name.lower().rstrip(b". ")
    return low not in (b".git", b"git~1") and name not in (b"", b".", b"..")


def git_path_ok(path: str) -> bool:
    return all(git_name_ok(os.fsencode(part)) for part in path.split("/"))


def git_mode(mode: int) -> str | None:
    """The git tree mode of a file, or None for what git cannot hold (devices, fifos)."""
    if stat.S_ISREG(mode):
        return "100755" if mode & stat.S_IXUSR else "100644"
    if stat.S_ISLNK(mode):
        return "120000"
    return None


_SPECIAL = re.compile(rb'[\x00-\x1f"\\\x7f]')


def cquote(path: bytes) -> bytes:
    """A path as a C-style quoted string, which fast-import always accepts."""
    if not _SPECIAL.search(path):
        return b'"' + path + b'"'
    out = bytearray(b'"')
    for c in path:
        if c in (0x22, 0x5C):
            out += b"\\" + bytes([c])
        elif c < 0x20 or c == 0x7F:
            out += b"\\%03o" % c
        else:
            out.append(c)
    out += b'"'
    return bytes(out)


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _person(name: str) -> str:
    return re.sub(r"[<>\n\0]", "", name).strip() or "overlayckpt"



def ref_name_ok(name: str) -> bool:
    """git check-ref-format rules for a branch name (checked here to save a process)."""
    if not name or name == "@" or name.startswith(("/", "-")) or name.endswith(("/", ".")):
        return False
    if ".." in name or "//" in name or "@{" in name:
        return False
    if any(c < " " or c == "\x7f" or c in " ~^:?*[\\" for c in name):
        return False
    return all(part and not part.startswith(".") and not part.endswith(".lock")
               for part in name.split("/"))


def session_name(store_path: str) -> str:
    name = os.path.basename(os.path.normpath(store_path))
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).replace("..", "-").strip(".-")
    if name.endswith(".lock"):
        name = name[:-5]
    return name or "session"


# -- git --------------------------------------------------------------------------

class Git:
    """Git plumbing on the repo's real .git, reached through the lower directory fd."""

    def __init__(self, s: Session, tmpdir: str) -> None:
        self.git_dir = f"/proc/{os.getpid()}/fd/{s.lower.fd}/.git"
        self.tmpdir = tmpdir
        if not os.path.exists(self.git_dir):
            raise UserError(f"{s.repo} is not a git repository (no .git in the repo as mounted): "
                            "'git init' it, or use 'export bundle' to keep the session")
        env = {k: v for k, v in os.environ.items()
               if k not in _GIT_LOCATION_ENV and not k.startswith(("GIT_AUTHOR_", "GIT_COMMITTER_"))}
        env.update(GIT_DIR=self.git_dir, GIT_TERMINAL_PROMPT="0", GIT_OPTIONAL_LOCKS="0", LC_ALL="C")
        self.env = env

    async def run(self, *args: str, stdin: Any = b"", check: bool = True) -> "trio.CompletedProcess":  # type: ignore[name-defined]
        argv = ["git", "--bare"]
        for c in _GIT_CONFIG:
            argv += ["-c", c]
        argv += list(args)
        try:
            proc = await trio.run_process(argv, stdin=stdin, capture_stdout=True, capture_stderr=True,
                                          check=False, env=self.env, cwd=self.tmpdir)
        except FileNotFoundError:
            raise UserError("git is not installed: install git to export checkpoints as commits") from None
        if check and proc.returncode != 0:
            raise UserError(f"git {args[0]} failed: {_last_line(proc.stderr)}")
        return proc

    def head_file(self) -> bytes:
        try:
            with open(os.path.join(self.git_dir, "HEAD"), "rb") as f:
                return f.read(4096).strip()
        except OSError:
            return b""


def _last_line(err: bytes) -> str:
    lines = [ln.strip() for ln in err.decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else "no error message"


def parse_trailers(message: bytes) -> dict[str, str]:
    """Our `Key: value` lines of a commit message (only at the start of a line)."""
    out: dict[str, str] = {}
    for line in message.decode(errors="replace").splitlines():
        m = re.match(r"(Checkpoint-[A-Za-z-]+|Overlayckpt-[A-Za-z-]+): (.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


class _Stream:
    """The fast-import command stream, spooled to a file (it may hold much file data)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.f = open(path, "wb")
        self.commits = 0

    def line(self, text: bytes) -> None:
        self.f.write(text + b"\n")

    def data(self, payload: bytes) -> None:
        self.f.write(b"data %d\n" % len(payload))
        self.f.write(payload)
        self.f.write(b"\n")

    def close(self) -> None:
        self.f.close()


class GitExport:
    """One export call: the checkpoints not yet on the branch (at most `limit` of them)."""

    def __init__(self, s: Session, branch: str | None) -> None:
        from .timeline import Timeline
        self.s = s
        self.ov = s.overlay
        self.tl: Timeline = Timeline(s)
        self.session = session_name(s.store.path)
        name = branch if branch is not None else f"overlayckpt/{self.session}"
        name = name.removeprefix("refs/heads/")
        if not ref_name_ok(name):
            raise UserError(f"{name!r} is not a valid git branch name: pick another --branch")
        self.branch = name
        self.ref = f"refs/heads/{name}"

    async def run(self, since: Any, limit: int) -> dict[str, Any]:
        self.tl.seal()  # pending changes become a checkpoint, so the export is up to date
        tmpdir = tempfile.mkdtemp(prefix="overlayckpt-export-")
        try:
            return await self._run(Git(self.s, tmpdir), tmpdir, since, limit)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)

    async def _run(self, git: Git, tmpdir: str, since: Any, limit: int) -> dict[str, Any]:
        if git.head_file() == b"ref: " + self.ref.encode():
            raise UserError(f"branch {self.branch} is checked out in {self.s.repo}: export to another "
                            "--branch (export never touches the checked-out branch)")
        tip, tip_msg = await self._tip(git)
        r = self.s.store.begin_read()
        try:
            cks = self.tl.all(r)
            origin = str(cks[0].time_ns)
            start = self.tl.get(r, since).id if since is not None else 0
            last: Checkpoint | None = None
            if tip is not None:
                last = self._last_exported(r, tip_msg, origin)
            todo = [ck for ck in cks if ck.id >= start and (last is None or ck.id > last.id)]
            remaining = len(todo)
            if limit:
                todo = todo[:limit]
            result: dict[str, Any] = {"branch": self.branch, "ref": self.ref, "exported": [],
                                      "tip": tip, "last": last.id if last else None}
            if not todo:
                result["remaining"] = 0
                return result
            stream = _Stream(os.path.join(tmpdir, "stream"))
            try:
                await self._write(git, r, stream, todo, last, tip, origin)
            finally:
                stream.close()
        finally:
            self.s.store.end_read(r)
        marks = os.path.join(tmpdir, "marks")
        with open(stream.path, "rb") as f:
            proc = await git.run("fast-import", "--quiet", "--done", f"--export-marks={marks}",
                                 stdin=f, check=False)
        if proc.returncode != 0:
            err = _last_line(proc.stderr)
            if "Not updating" in err:
                raise UserError(f"branch {self.branch} moved while exporting (another export?): "
                                "run the export again")
            raise UserError(f"git fast-import failed: {err}")
        commits = self._read_marks(marks)
        exported = [{"id": ck.id, "commit": commits[ck.id + 1]} for ck in todo]
        log.info("exported checkpoints %d..%d to %s", todo[0].id, todo[-1].id, self.ref)
        result.update(exported=exported, tip=exported[-1]["commit"], last=todo[-1].id,
                      remaining=remaining - len(todo))
        return result

    async def _tip(self, git: Git) -> tuple[str | None, bytes]:
        proc = await git.run("cat-file", "--batch", stdin=self.ref.encode() + b"\n")
        head, _, body = proc.stdout.partition(b"\n")
        parts = head.split()
        if len(parts) == 3 and parts[1] == b"commit":
            return parts[0].decode(), body[:int(parts[2])]
        if len(parts) == 3:
            raise UserError(f"{self.ref} is not a commit: pick another --branch")
        return None, b""

    def _last_exported(self, r: ReadTxn, message: bytes, origin: str) -> Checkpoint:
        trailers = parse_trailers(message)
        cid = trailers.get("Checkpoint-Id", "")
        if not cid.isdigit():
            raise UserError(f"branch {self.branch} exists and was not made by 'overlayckpt export git': "
                            "pick another --branch")
        if trailers.get("Overlayckpt-Origin") not in (None, origin):
            raise UserError(f"branch {self.branch} holds the checkpoints of another session "
                            f"({trailers.get('Overlayckpt-Session', '?')}): pick another --branch")
        try:
            return self.tl.get(r, int(cid))
        except UserError:
            raise UserError(f"branch {self.branch} ends at checkpoint {cid}, which this session does "
                            "not have: pick another --branch") from None

    @staticmethod
    def _read_marks(path: str) -> dict[int, str]:
        out = {}
        with open(path) as f:
            for line in f:
                mark, _, sha = line.strip().partition(" ")
                out[int(mark[1:])] = sha
        return out

    # -- building the stream ----------------------------------------------------

    async def _write(self, git: Git, r: ReadTxn, stream: _Stream, todo: list[Checkpoint],
                     last: Checkpoint | None, tip: str | None, origin: str) -> None:
        from .commands import checkpoint_entry
        prev = last
        for i, ck in enumerate(todo):
            entry = checkpoint_entry(r, self.s, ck)
            stream.line(b"commit " + self.ref.encode())
            stream.line(b"mark :%d" % (ck.id + 1))
            secs = ck.time_ns // 1_000_000_000
            author = f"{_person(ck.comm or 'overlayckpt')} <overlayckpt@localhost>"
            stream.line(f"author {author} {secs} +0000".encode())
            stream.line(f"committer {IDENT} {secs} +0000".encode())
            stream.data(self._message(r, ck, prev, entry, origin).encode(errors="replace"))
            if i == 0:
                if prev is not None:
                    stream.line(b"from " + (tip or "").encode())
                    await self._changes(r, stream, prev, ck)
                else:
                    await self._full_tree(git, r, stream, ck)
            else:
                await self._changes(r, stream, prev, ck)  # type: ignore[arg-type]
            stream.line(b"")
            prev = ck
            await trio.sleep(0)
        stream.line(b"done")

    async def _changes(self, r: ReadTxn, stream: _Stream, a: Checkpoint, b: Checkpoint) -> None:
        changes = self.tl.changes(r, a, b)
        adds = []
        for c in changes:
            if not git_path_ok(c.path):
                continue
            path = cquote(os.fsencode(c.path))
            new_mode = git_mode(c.new[0]) if c.new is not None else None
            if new_mode is None:
                if c.old is not None and git_mode(c.old[0]) is not None:
                    stream.line(b"D " + path)  # deletions first: a file may become a directory
            else:
                adds.append((new_mode, path, c.new[1]))  # type: ignore[index]
        for mode, path, data in adds:
            stream.line(f"M {mode} inline ".encode() + path)
            stream.data(data)

    async def _full_tree(self, git: Git, r: ReadTxn, stream: _Stream, ck: Checkpoint) -> None:
        """The first commit of a new branch: every file of ck, on top of the repo's HEAD."""
        state = self.tl.state(r, ck)
        fmt = (await git.run("rev-parse", "--show-object-format")).stdout.strip().decode()
        fmt = fmt if fmt in ("sha1", "sha256") else "sha1"  # git before 2.28 knows only sha1
        files: list[tuple[bytes, str, str, int, Node]] = []
        n = 0
        for path, ino, node in self._walk(state):
            mode = git_mode(node.mode)
            if mode is None:
                continue
            data = self._content(state, ino, node)
            h = hashlib.new(fmt.replace("-", ""))
            h.update(b"blob %d\0" % len(data))
            h.update(data)
            files.append((cquote(os.fsencode(path)), mode, h.hexdigest(), ino, node))
            n += 1
            if n % _YIELD_EVERY == 0:
                await trio.sleep(0)
        head_then = self._head_in(state)
        query = [f"{head_then}^{{commit}}" if head_then else "HEAD^{commit}", "HEAD^{commit}"]
        shas = sorted({sha for _, _, sha, _, _ in files})
        proc = await git.run("cat-file", "--batch-check",
                             stdin="".join(q + "\n" for q in query + shas).encode())
        answers = proc.stdout.decode().splitlines()
        if len(answers) != len(query) + len(shas):
            raise UserError("git cat-file gave an unexpected answer: is the repo's git too old?")
        parent = None
        for ans in answers[:2]:
            parts = ans.split()
            if len(parts) == 3 and parts[1] == "commit":
                parent = parts[0]
                break
        have = {ans.split()[0] for ans in answers[2:] if ans.split()[1:2] == ["blob"]}
        if parent is not None:
            stream.line(b"from " + parent.encode())
            stream.line(b"deleteall")
        for i, (path, mode, sha, ino, node) in enumerate(files):
            if sha in have:
                stream.line(f"M {mode} {sha} ".encode() + path)
            else:
                stream.line(f"M {mode} inline ".encode() + path)
                stream.data(self._content(state, ino, node))
                have.add(sha)  # the same content again: fast-import dedups, we save the read
            if i % _YIELD_EVERY == 0:
                await trio.sleep(0)

    def _walk(self, state: Any) -> Iterator[tuple[str, int, Node]]:
        """Every non-directory below the root, never entering a .git."""
        stack: list[tuple[int, str]] = [(ROOT_INO, "")]
        while stack:
            ino, prefix = stack.pop()
            for name, child, cnode in self.ov.entries(state, ino):
                if not git_name_ok(name):
                    continue
                node = cnode or self.ov.node(state, child)
                path = prefix + os.fsdecode(name)
                if node.is_dir:
                    stack.append((child, path + "/"))
                else:
                    yield path, child, node

    def _content(self, state: Any, ino: int, node: Node) -> bytes:
        if node.is_link:
            return self.ov.readlink(state, ino, node)
        return self.ov.read_all(state, ino, node)

    def _head_in(self, state: Any) -> str | None:
        """The commit HEAD named in the checkpoint's own .git (the repo's HEAD back then)."""
        def read(path: str) -> bytes | None:
            try:
                ino = self.ov.resolve(state, path)
                node = self.ov.node(state, ino)
                return self.ov.read_all(state, ino, node) if node.is_reg else None
            except FsError:
                return None
        value = read(".git/HEAD")
        for _ in range(5):
            if value is None:
                return None
            value = value.strip()
            if not value.startswith(b"ref: "):
                break
            name = value[5:].strip().decode(errors="replace")
            if not name.startswith("refs/") or ".." in name.split("/"):
                return None
            value = read(".git/" + name)
            if value is None:
                for line in (read(".git/packed-refs") or b"").splitlines():
                    sha, _, ref = line.partition(b" ")
                    if ref.strip() == name.encode() and not line.startswith((b"#", b"^")):
                        value = sha
                        break
        if value is not None and re.fullmatch(rb"[0-9a-f]{40}|[0-9a-f]{64}", value):
            return value.decode()
        return None

    # -- messages -----------------------------------------------------------------

    def _message(self, r: ReadTxn, ck: Checkpoint, prev: Checkpoint | None, entry: dict[str, Any],
                 origin: str) -> str:
        subject = _one_line(entry.get("summary") or f"checkpoint {ck.id}", 120)
        parts = [subject, ""]
        conv = self._conversation(r, ck, prev)
        if conv:
            since = f" since checkpoint {prev.id}" if prev is not None else ""
            parts += [f"Conversation{since}:"] + conv + [""]
        trailers = [("Checkpoint-Id", str(ck.id)), ("Checkpoint-Kind", ck.kind)]
        if ck.name:
            trailers.append(("Checkpoint-Name", ck.name))
        if ck.message and ck.message != subject:
            trailers.append(("Checkpoint-Message", _one_line(ck.message)))
        if ck.restored_from is not None:
            trailers.append(("Checkpoint-Restored-From", str(ck.restored_from)))
        trailers += [("Checkpoint-Time", iso_time(ck.time_ns)),
                     ("Checkpoint-Process", f"{ck.pid} {_one_line(ck.comm or '-', 40)}"),
                     ("Overlayckpt-Session", self.session), ("Overlayckpt-Origin", origin)]
        parts += [f"{k}: {v}" for k, v in trailers]
        return "\n".join(parts).replace("\0", "") + "\n"

    def _conversation(self, r: ReadTxn, ck: Checkpoint, prev: Checkpoint | None) -> list[str]:
        """The lines that joined the conversation between prev and ck, oldest first."""
        floor = prev.conv_head if prev is not None else 0
        lines: list[dict[str, Any]] = []
        key = ck.conv_head
        extra = 0
        while key and key > floor:
            raw = r.get(b"conv", u64(key))
            if raw is None:
                break
            line: dict[str, Any] = unpack_obj(raw)  # type: ignore[assignment]
            if len(lines) < CONV_LINES:
                lines.append(line)
            else:
                extra += 1
            key = line.get("_prev", 0)
        lines.reverse()
        out = [f"  ({extra} earlier lines left out)"] if extra else []
        for line in lines:
            content = line.get("content")
            text = content if isinstance(content, str) else json.dumps(content)
            if len(text) > CONV_CHARS:
                text = text[:CONV_CHARS] + "…"
            tool = f" [{line['tool']}]" if line.get("tool") else ""
            body = "\n    ".join(text.strip().splitlines()) or "(empty)"
            out.append(f"  {_one_line(str(line.get('role', '?')), 40)}{tool}: {body}")
        return out


_locks: "weakref.WeakKeyDictionary[Session, trio.Lock]" = weakref.WeakKeyDictionary()


@command("export_git", durable=True)
async def _export_git(s: Session, cmd: dict[str, Any]) -> dict[str, Any]:
    branch = cmd.get("branch")
    if branch is not None and not isinstance(branch, str):
        raise UserError('"branch" must be a string')
    limit = cmd.get("limit", 0)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise UserError('"limit" must be a non-negative integer')
    exporter = GitExport(s, branch)
    lock = _locks.setdefault(s, trio.Lock())
    async with lock:  # one export at a time per session (the daemon serves many requests)
        result = await exporter.run(cmd.get("since"), limit)
    if result["exported"]:
        await _show_new_git_objects(s, "refs/heads/" + result["branch"])
    return result


async def _show_new_git_objects(s: Session, ref: str) -> None:
    """Export added a pack and a ref (with its reflog) to the repo's .git behind the
    overlay: drop what the overlay and the kernel cached of .git, including negative
    entries for the ref's names, so git inside the mount sees them."""
    s.lower.forget_cached()
    if s.invalidate is None:
        return
    git_inos = {path: ino for ino, path in list(s.overlay.lower_paths.items())
                if path == b".git" or path.startswith(b".git/")}
    entries = []
    for top in (".git/", ".git/logs/"):
        parts = (top + ref).encode().split(b"/")
        for i in range(1, len(parts)):
            parent = git_inos.get(b"/".join(parts[:i]))
            if parent is not None:
                entries.append((parent, parts[i]))
    await s.invalidate(list(git_inos.values()), entries)


# -- bundles ------------------------------------------------------------------------

BUNDLE_MAGIC = "overlayckpt-bundle"
BUNDLE_VERSION = 1
_FLUSH = 1 << 20


def lower_identity(r: ReadTxn) -> tuple[list[list[Any]], list[bytes]]:
    """The lower inodes the session refers to, with their paths, and the pinned paths."""
    inos: dict[int, bytes] = {}

    def note(ino: int, raw: bytes) -> None:
        if ROOT_INO < ino < FIRST_UPPER_INO and ino not in inos:
            node = Node.unpack(raw)
            if node.origin is not None:
                inos[ino] = node.origin

    for k, v in r.range_from(b"nodes"):
        note(from_u64(k), v)
    for k, v in r.range_from(b"journal"):
        for table, key, old in JournalRecord.unpack(from_u64(k), v).undo:
            if table == T_NODES and old:
                note(from_u64(key), old)
    pinned = [k[1:] for k, _ in r.range_from(b"pinned")]
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
    for k, v in r.range_from(b"pinned"):
        if k != b"/":  # the root is always ROOT_INO
            out.setdefault(lower_ino(unpack_obj(v)["st"][1]), [k[1:], None, None, None])
    pinned = {e[0] for e in out.values()}
    for ino, path in lower:
        if path in pinned:
            out.setdefault(ino, [path, None, None, None])
        elif ino not in out:
            found = identity(path)
            out[ino] = [path, *found[1]] if found is not None else [path, 0, 0, None]
    return [[ino, *rest] for ino, rest in sorted(out.items())]


def seen_files(r: ReadTxn, identity: Identity) -> list[list[Any]]:
    """[path, size, digest] of the files the repo still holds as `seen` (apply's conflict
    check) recorded them: import gives a checkout holding the same content their fingerprint."""
    out = []
    for k, v in r.range_from(b"seen"):
        found = identity(k[1:])
        if (found is not None and stat.S_ISREG(found[0].st_mode)
                and unpack_obj(v) == seen_fingerprint(found[0])):
            out.append([k[1:], found[1][1], found[1][2]])
    return out


def write_bundle(store: Store, path: str, info: dict[str, Any], lower_fd: int) -> dict[str, Any]:
    """Write every table of the store, as one consistent snapshot, into a bundle file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    counts: dict[str, int] = {}

    def fn(r: ReadTxn) -> dict[str, Any]:
        lower, pinned = lower_identity(r)
        identity = identities(lower_fd)
        header = {"bundle": BUNDLE_MAGIC, "version": BUNDLE_VERSION, "format": r.meta_int(b"format"),
                  "block_size": store.block_size, "tables": [t.decode() for t in TABLES],
                  "created": iso_time(time.time_ns()), "lower": lower, "pinned": pinned,
                  "lower_files": lower_files(r, identity, lower),
                  "seen_files": seen_files(r, identity), **info}
        packer = msgpack.Packer()
        with open(tmp, "wb") as f:
            with zstandard.ZstdCompressor(level=3).stream_writer(f, closefd=False) as z:
                buf = bytearray(packer.pack(header))
                for ti, table in enumerate(TABLES):
                    n = 0
                    for k, v in r.range_from(table):
                        buf += packer.pack([ti, k, v])
                        n += 1
                        if len(buf) >= _FLUSH:
                            z.write(bytes(buf))
                            buf.clear()
                    counts[table.decode()] = n
                buf += packer.pack({"end": True, "counts": counts})
                z.write(bytes(buf))
            f.flush()
            os.fsync(f.fileno())
        return {"checkpoints": counts["ckpts"], "blocks": counts["blocks"],
                "journal": counts["journal"]}

    try:
        result = store.read(fn)
        os.replace(tmp, path)
    except OSError as e:
        _unlink(tmp)
        raise UserError(f"cannot write bundle {path}: {e.strerror or e}: pick a writable path") from None
    except BaseException:
        _unlink(tmp)
        raise
    return {"path": path, "bytes": os.path.getsize(path), "records": counts, **result}


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@command("export_bundle")
async def _export_bundle(s: Session, cmd: dict[str, Any]) -> dict[str, Any]:
    path = cmd.get("path")
    if not isinstance(path, str) or not os.path.isabs(path):
        raise UserError('export_bundle needs "path": an absolute file path')
    mnt = s.mountpoint
    # never stat or open anything inside our own mount: the daemon would wait on itself
    if mnt and (path == mnt or path.startswith(mnt.rstrip("/") + "/")):
        raise UserError(f"{path} is inside the mount {mnt}: write the bundle outside it")
    info = {"repo": s.repo, "window": s.overlay.window, "session": session_name(s.store.path)}
    return await trio.to_thread.run_sync(write_bundle, s.store, path, info, s.lower.fd)


class _Bundle:
    """Reading a bundle: the header, then records, then the trailer."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.f = open(path, "rb")
        except OSError as e:
            raise UserError(f"cannot read bundle {path}: {e.strerror}") from None
        self.unpacker = msgpack.Unpacker(zstandard.ZstdDecompressor().stream_reader(self.f),
                                         raw=False, strict_map_key=False,
                                         max_buffer_size=1 << 31)
        header = self._next()
        if (not isinstance(header, dict) or header.get("bundle") != BUNDLE_MAGIC
                or not isinstance(header.get("tables"), list)):
            raise UserError(f"{path} is not an overlayckpt bundle: give a file made by "
                            "'overlayckpt export bundle'")
        if header.get("version") != BUNDLE_VERSION or int(header.get("format", 0)) > FORMAT_VERSION:
            raise UserError(f"{path} is a bundle of a newer overlayckpt: upgrade overlayckpt to import it")
        lower, pinned = header.get("lower", []), header.get("pinned", [])
        if (not isinstance(header.get("block_size"), int) or not isinstance(lower, list)
                or not isinstance(pinned, list) or not all(isinstance(t, str) for t in header["tables"])
                or not all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], int)
                           and isinstance(e[1], bytes) for e in lower)
                or not all(isinstance(p, bytes) for p in pinned)
                or not _rows_ok(header.get("lower_files", []), 5, 1)
                or not _rows_ok(header.get("seen_files", []), 3, 0)):
            raise UserError(f"{path} is damaged (its header is malformed): export the bundle again")
        self.header = header
        self.tables = [t.encode() for t in header["tables"]]
        if any(t not in TABLES for t in self.tables):
            raise UserError(f"{path} holds tables this overlayckpt does not know: upgrade overlayckpt")

    def _next(self) -> Any:
        try:
            return next(self.unpacker)
        except StopIteration:
            raise UserError(f"{self.path} is truncated or not an overlayckpt bundle") from None
        except UserError:
            raise
        except Exception as e:  # zstd or msgpack: the file is damaged or something else
            raise UserError(f"{self.path} is not a valid overlayckpt bundle ({e})") from None

    def records(self) -> Iterator[tuple[bytes, bytes, bytes]]:
        while True:
            rec = self._next()
            if isinstance(rec, dict):
                if not rec.get("end"):
                    break
                self.trailer = rec
                return
            if (not isinstance(rec, list) or len(rec) != 3 or not isinstance(rec[0], int)
                    or not 0 <= rec[0] < len(self.tables) or not isinstance(rec[1], bytes)
                    or not rec[1] or not isinstance(rec[2], bytes)):
                break
            yield self.tables[rec[0]], rec[1], rec[2]
        raise UserError(f"{self.path} is damaged (a record is malformed): export the bundle again")

    def close(self) -> None:
        self.f.close()


def _rows_ok(rows: Any, n: int, path_at: int) -> bool:
    """Header rows (lower_files, seen_files) of n ints, bytes or nils, with a path at path_at."""
    return isinstance(rows, list) and all(
        isinstance(e, list) and len(e) == n and isinstance(e[path_at], bytes)
        and all(isinstance(x, (int, bytes, type(None))) for x in e) for e in rows)


def check_repo(header: dict[str, Any], repo: str) -> None:
    """Refuse a repo that is not the directory the session recorded (its inodes differ)."""
    pinned = {bytes(p) for p in header.get("pinned", [])}
    for ino, origin in header.get("lower", []):
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


def repo_remap(header: dict[str, Any], repo: str, bundle_path: str) -> _Remap | None:
    """How the inodes of the recorded repo become those of repo, after checking that repo
    holds what the session refers to; None when repo is the recorded directory (same inodes)."""
    files = header.get("lower_files")
    if files is None:  # a bundle from before lower_files: only the same directory will do
        check_repo(header, repo)
        return None
    # a number given out by the overlay (a pin an earlier import renumbered) is no repo's
    files = [f for f in files if ROOT_INO < f[0] < FIRST_UPPER_INO]
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
        seen: dict[bytes, list[int]] = {}
        for path, size, digest in header.get("seen_files", []):
            found = identity(path)
            if found is not None and found[1] == [stat.S_IFREG, size, digest]:
                seen[path] = seen_fingerprint(found[0])
    finally:
        os.close(dirfd)
    # two recorded files must not become one (hard links the recorded repo did not have)
    paths = {ino: path for ino, path, *_ in files}
    owner: dict[int, int] = {}
    for old, new in inos.items():
        first = owner.setdefault(new, old)
        if first != old:
            a, b = os.fsdecode(paths[first]), os.fsdecode(paths[old])
            raise UserError(f"{a} and {b} are one file (hard links) in {repo} but not in the repo "
                            "this session was recorded on: import into a checkout where they are "
                            "separate files (--repo)")
    return _Remap(inos, seen, bundle_path, absent)


class _Remap:
    """Rewrites the lower inodes held in store entries from the recorded repo's to the target's.

    They are: the keys of nodes, dirents, bmap and xattrs (the inode comes first), dirent
    values, a node's parent hint, the same in journal undo entries, a pin's st_ino and the
    inode `seen` fingerprints. Root, upper and control inodes never change.

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
            return [(b"next_ino", u64(FIRST_UPPER_INO + len(self.absent)))]
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
        if table in (b"nodes", b"dirents", b"bmap", b"xattrs"):
            key = self._head(key)
        if value is None:
            return key, None
        if table == b"nodes":
            node = Node.unpack(value)
            node.parent = self.ino(node.parent, hint=True)
            value = node.pack()
        elif table == b"dirents" and value != WHITEOUT:
            value = self._head(value)
        elif table == b"journal":
            rec = JournalRecord.unpack(from_u64(key), value)
            undo = []
            for t, k, v in rec.undo:  # (table, key, old value): encoded as in the tables
                k, v = self.entry(TABLE_NAMES[t], k, v)
                undo.append((t, k, v))
            value = dataclasses.replace(rec, undo=tuple(undo)).pack()
        elif table == b"pinned":
            pin = unpack_obj(value)
            new = self.inos.get(lower_ino(pin["st"][1]))
            if new is not None:
                pin["st"][1] = 1 if new == LOWER_INO_ONE else new  # st_ino as lstat gave it
                value = pack_obj(pin)
        elif table == b"seen" and key[1:] in self.seen:
            # [ino, size, mtime] of the repo's file: the target's when it holds the same
            # content; otherwise the old one stays, and apply compares the content
            value = pack_obj(self.seen[key[1:]])
        return key, value

    def row(self, table: bytes, key: bytes, value: bytes) -> tuple[bytes, bytes]:
        if table == b"meta":
            if key != b"next_ino":
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


def _store_is_empty(store: Store) -> bool:
    def fn(r: ReadTxn) -> bool:
        if any(r.count(t) for t in TABLES if t != b"meta"):
            return False
        return all(k in (b"format", b"block_size") for k, _ in r.range_from(b"meta"))
    return store.read(fn)


def import_bundle(path: str, store_dir: str | None, repo: str | None) -> dict[str, Any]:
    bundle = _Bundle(path)
    try:
        header = bundle.header
        repo = repo or header.get("repo")
        if not repo or not os.path.isdir(repo):
            raise UserError(f"the bundle's repo {repo} is not a directory here: give --repo DIR "
                            "(the directory the session was recorded on, or a checkout of it)")
        repo = os.path.realpath(repo)
        remap = repo_remap(header, repo, path)
        store_dir = os.path.abspath(store_dir or default_store_dir(repo))
        if os.path.exists(store_dir) and not os.path.isdir(store_dir):
            raise UserError(f"{store_dir} exists and is not a directory: pick another --store")
        before = set(os.listdir(store_dir)) if os.path.isdir(store_dir) else None
        store = Store.open(store_dir, create=True, block_size=int(header["block_size"]))
        failed = True
        try:
            if not _store_is_empty(store):
                failed = False  # not ours to clean
                raise UserError(f"store {store_dir} already holds a session: import into a new "
                                "--store (import never merges sessions)")
            counts = _load(store, bundle, remap)
            failed = False
        finally:
            if failed and before is not None and "data.mdb" in before:
                _clear(store)
            store.close()
            if failed and (before is None or "data.mdb" not in before):
                _remove_new(store_dir, before)
    finally:
        bundle.close()
    info = read_info(store_dir)
    info.update(repo=repo, window=header.get("window", 1.0), block_size=int(header["block_size"]),
                imported_from=os.path.abspath(path))
    write_info(store_dir, info)
    return {"store": store_dir, "repo": repo, "checkpoints": counts.get("ckpts", 0),
            "blocks": counts.get("blocks", 0), "records": counts}


def _remove_new(store_dir: str, before: set[str] | None) -> None:
    """Undo a failed import into a directory it created or found empty."""
    if before is None:
        shutil.rmtree(store_dir, ignore_errors=True)
        return
    for name in set(os.listdir(store_dir)) - before:
        _unlink(os.path.join(store_dir, name))


def _load(store: Store, bundle: _Bundle, remap: _Remap | None = None) -> dict[str, int]:
    counts = {t.decode(): 0 for t in TABLES}
    batch: list[tuple[bytes, bytes, bytes]] = []
    size = 0

    def flush() -> None:
        def fn(w: Any) -> None:
            for table, key, value in batch:
                if table == b"blocks" and w.get(b"blocks", key) is not None:
                    continue  # content-addressed: already here
                w.put(table, key, value)
        store.write(fn)
        batch.clear()

    for table, key, value in bundle.records():
        if table == b"blocks":
            try:
                ok = blake3.blake3(store.decode_block(value)).digest() == key
            except Exception:
                ok = False
            if not ok:
                raise UserError(f"{bundle.path} is damaged (block {key.hex()[:16]} does not match its "
                                "digest): export the bundle again")
        counts[table.decode()] += 1
        if remap is not None:
            key, value = remap.row(table, key, value)
        batch.append((table, key, value))
        size += len(key) + len(value)
        if len(batch) >= 20000 or size >= 64 << 20:
            flush()
            size = 0
    if remap is not None:
        batch += [(b"meta", key, value) for key, value in remap.meta_rows()]
    if batch:
        flush()
    expected = getattr(bundle, "trailer", {}).get("counts")
    if expected != counts:
        raise UserError(f"{bundle.path} is incomplete (expected {expected}, found {counts}): "
                        "export the bundle again")
    return counts


def _clear(store: Store) -> None:
    """Empty a store that an import failed to fill (it was empty before)."""
    def fn(w: Any) -> None:
        for table in TABLES:
            if table == b"meta":
                for k, _ in list(w.range_from(b"meta")):
                    if k not in (b"format", b"block_size"):
                        w.delete(b"meta", k)
            else:
                w.txn.drop(store.dbs[table], delete=False)
    store.write(fn)


# -- command line -------------------------------------------------------------------

def parse_duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: use e.g. 30s, 5m, 1h")
    scale = {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[m.group(2)]
    return float(m.group(1)) * scale


def _export_all(target: Any, args: argparse.Namespace, quiet: bool = False) -> dict[str, Any]:
    """Export until the branch has every checkpoint, CHUNK at a time (one request each)."""
    cmd: dict[str, Any] = {"cmd": "export_git", "limit": CHUNK}
    if args.branch is not None:
        cmd["branch"] = args.branch
    if args.since is not None:
        cmd["since"] = int(args.since) if args.since.isdigit() else args.since
    done: list[dict[str, Any]] = []
    total = None
    while True:
        result = target.call(cmd)
        done += result["exported"]
        if total is None:
            total = len(result["exported"]) + result["remaining"]
        if total > CHUNK and result["exported"] and not quiet:
            print(f"overlayckpt: exported {len(done)}/{total} checkpoints to {result['branch']}",
                  file=sys.stderr, flush=True)
        if not result["remaining"] or not result["exported"]:
            break
    result["exported"] = done
    result.pop("remaining", None)
    return result


def _export_text(r: dict[str, Any]) -> str:
    tip = (r["tip"] or "")[:12]
    if not r["exported"]:
        where = f" (checkpoint {r['last']}, {tip})" if r.get("last") is not None else ""
        return f"{r['branch']} is up to date{where}"
    ids = [e["id"] for e in r["exported"]]
    span = f"{ids[0]}" if len(ids) == 1 else f"{ids[0]}..{ids[-1]}"
    return (f"exported {len(ids)} checkpoint{'s' if len(ids) != 1 else ''} ({span}) to "
            f"{r['branch']} ({tip})")


def cmd_export(args: argparse.Namespace) -> int:
    from .cli import Target, emit
    if args.kind == "bundle":
        if not args.file:
            raise UserError("export bundle needs a FILE: overlayckpt export bundle FILE")
        if args.branch is not None or args.since is not None or args.every is not None:
            raise UserError("--branch, --since and --every belong to 'export git'")
        path = _bundle_path(args.file)
        target = Target(args)
        result = target.call({"cmd": "export_bundle", "path": path})
        emit(args, result, lambda r: f"wrote {r['path']}: {r['checkpoints']} checkpoints, "
                                     f"{r['blocks']} blocks, {r['bytes']} bytes")
        return 0
    if args.file:
        raise UserError(f"export git takes no FILE (got {args.file!r}): overlayckpt export git "
                        "[--branch NAME] [--since ID]")
    target = Target(args)
    if args.every is None:
        emit(args, _export_all(target, args), _export_text)
        return 0
    return _export_every(target, args)


def _export_every(target: Any, args: argparse.Namespace) -> int:
    """Export, then again every DURATION, until interrupted or the session unmounts.
    A first Ctrl-C lets an export under way finish and report; a second stops at once."""
    from .cli import emit
    store = target.store or target.call({"cmd": "status"}).get("store")
    stop = False

    def on_sigint(signum: int, frame: Any) -> None:
        nonlocal stop
        if stop:
            raise KeyboardInterrupt
        stop = True

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        while not stop:
            try:
                result = _export_all(target, args)
            except UserError:
                if target.mount is None or os.path.exists(os.path.join(target.mount, ".overlayckpt", "ctl")):
                    raise
                # the session was unmounted: one last export from its store, then stop
                result = _export_offline_when_free(store, args)
                if result["exported"]:
                    emit(args, result, _export_text)
                return 0
            if result["exported"]:
                emit(args, result, _export_text)
                sys.stdout.flush()
            deadline = time.monotonic() + args.every
            while not stop and time.monotonic() < deadline:
                time.sleep(min(0.1, args.every))
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGINT, previous)


def _export_offline_when_free(store: str, args: argparse.Namespace) -> dict[str, Any]:
    from . import client
    from .errors import StoreLocked

    class Offline:
        def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
            return client.offline(store, cmd)

    deadline = time.monotonic() + 120
    while True:
        try:
            return _export_all(Offline(), args, quiet=True)
        except StoreLocked:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _bundle_path(file: str) -> str:
    path = os.path.abspath(file)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise UserError(f"cannot write bundle {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write bundle {path}: directory {parent} is not writable")
    if os.path.isdir(path):
        raise UserError(f"cannot write bundle {path}: it is a directory; give a file name")
    return os.path.join(os.path.realpath(parent), os.path.basename(path))


def cmd_import(args: argparse.Namespace) -> int:
    from .cli import emit
    result = import_bundle(args.file, args.store, args.repo)
    emit(args, result, lambda r: f"imported {r['checkpoints']} checkpoints into {r['store']} "
                                 f"(repo {r['repo']}); 'overlayckpt --store {r['store']} log' lists them")
    return 0


def add_cli(sub: Any, handlers: dict[str, Callable[[argparse.Namespace], int]]) -> None:
    """Add the `export` and `import` subcommands to the CLI."""
    e = sub.add_parser("export", help="checkpoints as git commits (export git), or the session "
                                      "as one file (export bundle FILE)")
    e.add_argument("kind", choices=["git", "bundle"])
    e.add_argument("file", nargs="?", help="bundle: the file to write")
    e.add_argument("--branch", help="git: the branch to write (default overlayckpt/<session>)")
    e.add_argument("--since", help="git: start at this checkpoint (id or name) on a new branch")
    e.add_argument("--every", type=parse_duration, metavar="DURATION",
                   help="git: export again every DURATION (30s, 5m) until interrupted")
    i = sub.add_parser("import", help="load a session bundle into a new store")
    i.add_argument("file")
    i.add_argument("--repo", help="the repo the session belongs to (default: the one recorded)")
    handlers["export"] = cmd_export
    handlers["import"] = cmd_import
