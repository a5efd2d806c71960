"""Checkpoints as git commits (export git).

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

Concurrency: in the daemon, reading the store and the tree runs on the trio
thread in synchronous steps (a read transaction may stay open across awaits,
never a write transaction); git runs as an async subprocess, so the mount
keeps serving meanwhile. The bundle writer reads only raw tables, in a
thread of its own.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import trio

from overlayckpt.core.context import Context
from overlayckpt.core.summaries import checkpoint_entry
from overlayckpt.core.timeline import Timeline
from overlayckpt.errors import FsError, UserError
from overlayckpt.export.git import Git, Stream, last_line, parse_trailers
from overlayckpt.export.gitnames import (
    cquote,
    git_mode,
    git_name_ok,
    git_path_ok,
    one_line,
    person,
    ref_name_ok,
    session_name,
)
from overlayckpt.messages import Exported, ExportGitReply, LogEntry, Ref
from overlayckpt.records import ROOT_INO, Checkpoint, Node, iso_time, u64, unpack_obj
from overlayckpt.store.txn import ReadTxn
from overlayckpt.tables import CONV

log = logging.getLogger(__name__)


IDENT = "overlayckpt <overlayckpt@localhost>"
CONV_LINES = 200  # conversation lines kept in one commit message
CONV_CHARS = 1000  # characters kept of one conversation line
_YIELD_EVERY = 256  # tree entries between two chances for the daemon to serve FUSE
class GitExport:
    """One export call: the checkpoints not yet on the branch (at most `limit` of them)."""

    def __init__(self, s: Context, branch: str | None) -> None:
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

    async def run(self, since: Ref | None, limit: int) -> ExportGitReply:
        self.tl.seal()  # pending changes become a checkpoint, so the export is up to date
        tmpdir = tempfile.mkdtemp(prefix="overlayckpt-export-")
        try:
            return await self._run(Git(self.s, tmpdir), tmpdir, since, limit)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)

    async def _run(self, git: Git, tmpdir: str, since: Ref | None, limit: int) -> ExportGitReply:
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
            if not todo:
                return {"branch": self.branch, "ref": self.ref, "exported": [], "tip": tip,
                        "last": last.id if last else None, "remaining": 0}
            stream = Stream(os.path.join(tmpdir, "stream"))
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
            err = last_line(proc.stderr)
            if "Not updating" in err:
                raise UserError(f"branch {self.branch} moved while exporting (another export?): "
                                "run the export again")
            raise UserError(f"git fast-import failed: {err}")
        commits = self._read_marks(marks)
        exported: list[Exported] = [{"id": ck.id, "commit": commits[ck.id + 1]} for ck in todo]
        log.info("exported checkpoints %d..%d to %s", todo[0].id, todo[-1].id, self.ref)
        return {"branch": self.branch, "ref": self.ref, "exported": exported,
                "tip": exported[-1]["commit"], "last": todo[-1].id,
                "remaining": remaining - len(todo)}

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
        if not (cid.isascii() and cid.isdigit()):  # (int("²") fails)
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

    async def _write(self, git: Git, r: ReadTxn, stream: Stream, todo: list[Checkpoint],
                     last: Checkpoint | None, tip: str | None, origin: str) -> None:
        prev = last
        for i, ck in enumerate(todo):
            entry = checkpoint_entry(r, ck)
            stream.line(b"commit " + self.ref.encode())
            stream.line(b"mark :%d" % (ck.id + 1))
            secs = ck.time_ns // 1_000_000_000
            author = f"{person(ck.comm or 'overlayckpt')} <overlayckpt@localhost>"
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
                await self._changes(r, stream, prev, ck)  # type: ignore[arg-type]  # after the first, prev is set
            stream.line(b"")
            prev = ck
            await trio.sleep(0)
        stream.line(b"done")

    async def _changes(self, r: ReadTxn, stream: Stream, a: Checkpoint, b: Checkpoint) -> None:
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
                adds.append((new_mode, path, c.new[1]))  # type: ignore[index]  # not a deletion: c.new is set
        for mode, path, data in adds:
            stream.line(f"M {mode} inline ".encode() + path)
            stream.data(data)

    async def _full_tree(self, git: Git, r: ReadTxn, stream: Stream, ck: Checkpoint) -> None:
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
        for i, (quoted, mode, sha, ino, node) in enumerate(files):
            if sha in have:
                stream.line(f"M {mode} {sha} ".encode() + quoted)
            else:
                stream.line(f"M {mode} inline ".encode() + quoted)
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

    def _message(self, r: ReadTxn, ck: Checkpoint, prev: Checkpoint | None, entry: LogEntry,
                 origin: str) -> str:
        subject = one_line(entry["summary"] or f"checkpoint {ck.id}", 120)
        parts = [subject, ""]
        conv = self._conversation(r, ck, prev)
        if conv:
            since = f" since checkpoint {prev.id}" if prev is not None else ""
            parts += [f"Conversation{since}:"] + conv + [""]
        trailers = [("Checkpoint-Id", str(ck.id)), ("Checkpoint-Kind", ck.kind)]
        if ck.name:
            trailers.append(("Checkpoint-Name", ck.name))
        if ck.message and ck.message != subject:
            trailers.append(("Checkpoint-Message", one_line(ck.message)))
        if ck.restored_from is not None:
            trailers.append(("Checkpoint-Restored-From", str(ck.restored_from)))
        trailers += [("Checkpoint-Time", iso_time(ck.time_ns)),
                     ("Checkpoint-Process", f"{ck.pid} {one_line(ck.comm or '-', 40)}"),
                     ("Overlayckpt-Session", self.session), ("Overlayckpt-Origin", origin)]
        parts += [f"{k}: {v}" for k, v in trailers]
        return "\n".join(parts).replace("\0", "") + "\n"

    def _conversation(self, r: ReadTxn, ck: Checkpoint, prev: Checkpoint | None) -> list[str]:
        """The lines that joined the conversation between prev and ck, oldest first."""
        floor = prev.conv_head if prev is not None else 0
        lines: list[Mapping[str, object]] = []  # (a line: what its writer sent, plus ours)
        key = ck.conv_head
        extra = 0
        while key and key > floor:
            raw = r.get(CONV, u64(key))
            if raw is None:
                break
            line: Mapping[str, object] = unpack_obj(raw)
            if len(lines) < CONV_LINES:
                lines.append(line)
            else:
                extra += 1
            prev_key = line.get("_prev", 0)
            key = prev_key if isinstance(prev_key, int) else 0
        lines.reverse()
        out = [f"  ({extra} earlier lines left out)"] if extra else []
        for line in lines:
            content = line.get("content")
            text = content if isinstance(content, str) else json.dumps(content)
            if len(text) > CONV_CHARS:
                text = text[:CONV_CHARS] + "…"
            tool = f" [{line['tool']}]" if line.get("tool") else ""
            body = "\n    ".join(text.strip().splitlines()) or "(empty)"
            out.append(f"  {one_line(str(line.get('role', '?')), 40)}{tool}: {body}")
        return out
