"""Claude Code and Codex transcripts cut back to a checkpoint (restore --both), so the
agent resumes from there.

The transcript is named by a conversation line, which anyone who can write ctl (the
agent) can forge: it is read and its copy written only beneath where the agent keeps
this user's transcripts, never through a symlink.
"""
from __future__ import annotations

import json
import os
import stat
from typing import Any

from overlayckpt.core.agents import TOOL_EVENTS, TRANSCRIPT_AGENTS


def _claude_result(entry: dict[str, Any], call_id: str) -> bool:
    message = entry.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") == "tool_result" and b.get("tool_use_id") == call_id
        for b in content)


def _codex_result(entry: dict[str, Any], call_id: str) -> bool:
    payload = entry.get("payload")
    return entry.get("type") == "response_item" and isinstance(payload, dict) \
        and payload.get("type") in ("function_call_output", "custom_tool_call_output") \
        and payload.get("call_id") == call_id


def transcript_root(agent: str) -> str:
    """The directory where the agent keeps this user's transcripts (Claude Code:
    CLAUDE_CONFIG_DIR or ~/.claude, then projects/; Codex: CODEX_HOME or ~/.codex, then
    sessions/), as the daemon's environment (the user's, at mount time) names it."""
    home = os.path.expanduser("~")
    if agent == "codex":
        return os.path.join(os.environ.get("CODEX_HOME") or os.path.join(home, ".codex"), "sessions")
    return os.path.join(os.environ.get("CLAUDE_CONFIG_DIR") or os.path.join(home, ".claude"), "projects")


class Transcript:
    """A transcript named by a conversation line (which the agent can forge), opened
    beneath its agent's transcript root one component at a time, never through a symlink:
    `dir_fd` holds it (the cut copy goes there), `fd` reads it. Close it when done."""

    def __init__(self, path: Any, agent: str) -> None:
        import errno
        from overlayckpt.names import quote_path
        root = transcript_root(agent)
        shown = quote_path(path) if isinstance(path, str) else repr(path)
        if not isinstance(path, str) or not os.path.isabs(path) or "\0" in path:
            raise ValueError(f"{shown} is not an absolute path")
        # lexically beneath the root as the user spells it, or as it resolves (the root
        # itself may be a link the user made: only what lies below it is walked strictly)
        rest = None
        for base in dict.fromkeys((os.path.normpath(root), os.path.realpath(root))):
            if path.startswith(base.rstrip("/") + "/"):
                rest = path[len(base.rstrip("/")) + 1:].split("/")
                break
        if rest is None or any(part in ("", ".", "..") for part in rest):
            raise ValueError(f"{shown} is not in {quote_path(root)}, where {agent} keeps its transcripts")
        self.path = path
        uid = os.getuid()
        fd = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in rest[:-1]:
                try:
                    step = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except NotADirectoryError:
                    raise ValueError(f"{shown} goes through a symlink or a file") from None
                os.close(fd)
                fd = step
            if os.fstat(fd).st_uid != uid:
                raise ValueError(f"{shown} lies in a directory of another user")
            try:
                src = os.open(rest[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise ValueError(f"{shown} is a symlink") from None
                raise
            st = os.fstat(src)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                os.close(src)
                raise ValueError(f"{shown} is not a regular file of this user")
        except BaseException:
            os.close(fd)
            raise
        self.dir_fd, self.fd = fd, src

    def lines(self) -> Any:
        return os.fdopen(os.dup(self.fd), encoding="utf-8", errors="surrogateescape")

    def write_copy(self, name: str, lines: list[str]) -> str:
        """A new file beside the transcript, 0600 as the agents keep theirs; its path."""
        from overlayckpt.names import is_file_name
        if not is_file_name(name.encode("utf-8", "surrogateescape")):
            raise ValueError(f"cannot name a copy {name!r}")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self.dir_fd)
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as dst:
            dst.writelines(lines)
        return os.path.join(os.path.dirname(self.path), name)

    def close(self) -> None:
        os.close(self.fd)
        os.close(self.dir_fd)


def resume_command(lines: list[dict[str, Any]]) -> tuple[str, str] | None:
    """The agent transcript of a checkpoint's conversation (its lines, oldest first) cut
    back to it: (the command that resumes it, the copy's path); None if there is none.

    The newest line naming a transcript that exists decides; ValueError (saying why) if
    that transcript is not where its agent keeps them: a line may be forged by anyone who
    can write ctl, and nothing is read or written outside the agent's own directory."""
    for line in reversed(lines):
        path = line.get("transcript_path")
        agent = line.get("agent")
        if agent not in TRANSCRIPT_AGENTS or not path:
            continue
        try:
            transcript = Transcript(path, agent)
        except FileNotFoundError:
            continue  # gone (deleted by the agent or the user): an older one may remain
        try:
            call = line.get("tool_use_id") if line.get("event") in TOOL_EVENTS else None
            if agent == "codex":
                session, copy = cut_codex_rollout(transcript, line["time"], call)
                return f"codex resume {session}", copy
            copy = cut_transcript(transcript, line["time"], call)
            return f"claude --resume {copy}", copy
        finally:
            transcript.close()
    return None


def _cut(transcript: Transcript, until_iso: str, is_end: Any) -> list[str]:
    """A JSONL transcript's lines (as written) through the first entry is_end accepts,
    or, if none does, those stamped no later than until_iso."""
    import datetime
    until = datetime.datetime.fromisoformat(until_iso.replace("Z", "+00:00"))
    entries: list[tuple[str, dict[str, Any]]] = []
    with transcript.lines() as src:
        for line in src:
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            if isinstance(entry, dict):
                entries.append((line if line.endswith("\n") else line + "\n", entry))
    ends = [i for i, (_, e) in enumerate(entries) if is_end(e)]
    if ends:
        return [line for line, _ in entries[:ends[0] + 1]]
    kept = []
    for line, entry in entries:
        stamp = entry.get("timestamp")
        if isinstance(stamp, str) and datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")) > until:
            break
        kept.append(line)
    return kept


def cut_transcript(transcript: Transcript, until_iso: str, tool_use_id: str | None = None) -> str:
    """Copy a Claude Code transcript up to a point, beside it; returns the copy's path.

    The point is a tool call's result when tool_use_id is given (the transcript names
    calls by the ids the hooks log), else a time. The copy keeps the session id: Claude
    keeps its file-history backups by session, and its own /rewind reaches the earlier
    prompts only under that id (resumed, Claude appends the new turns to the session's
    own transcript, as a branch from the cut). `claude --resume COPY` works from any
    directory.
    """
    import uuid
    kept = _cut(transcript, until_iso, lambda e: tool_use_id is not None and _claude_result(e, tool_use_id))
    return transcript.write_copy(str(uuid.uuid4()) + ".jsonl", kept)


def cut_codex_rollout(rollout: Transcript, until_iso: str, call_id: str | None = None) -> tuple[str, str]:
    """Copy a Codex rollout up to a call's output (else a time) as a session of its own,
    beside it; returns (its id, its path). Codex finds a session by the id in its first
    line (session_meta) and in the file's name; `codex resume ID` works from any directory."""
    import uuid
    kept = _cut(rollout, until_iso, lambda e: call_id is not None and _codex_result(e, call_id))
    new_id = str(uuid.uuid4())
    old_id = None
    for i, line in enumerate(kept):
        entry = json.loads(line)
        payload = entry.get("payload")
        if entry.get("type") == "session_meta" and isinstance(payload, dict) and payload.get("id"):
            old_id = str(payload["id"])
            kept[i] = line.replace(old_id, new_id)
            break
    if old_id is None:
        raise ValueError(f"{os.path.basename(rollout.path)} has no session id")
    name = os.path.basename(rollout.path)
    name = name.replace(old_id, new_id) if old_id in name else f"rollout-{new_id}.jsonl"
    return new_id, rollout.write_copy(name, kept)
