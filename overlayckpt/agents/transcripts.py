"""Claude Code, Codex, qwen-code and Gemini CLI transcripts cut back to a checkpoint
(restore --both), so the agent resumes from there.

Claude's and Codex's transcripts name each call by the id the hooks log; qwen's hooks
send an id of their own and Gemini's none, so theirs are cut by position: the call of
the checkpoint's last tool line is found by the order of the calls in its batch and the
times of the hook lines and of the results in the transcript.

The transcript is named by a conversation line, which anyone who can write ctl (the
agent) can forge: it is read and its copy written only beneath where the agent keeps
this user's transcripts, never through a symlink.
"""
from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from overlayckpt.agents.hooks import TOOL_EVENTS, TRANSCRIPT_AGENTS

# A transcript's record, a parsed JSON object the agent wrote: every value checked before use
Entry = dict[str, object]
# A record as (its line as written, parsed)
Record = tuple[str, Entry]
# The checkpoint's conversation lines (conversation.live_lines), which anyone who can write
# ctl can forge: every value checked too
Lines = Sequence[Mapping[str, object]]


def _claude_result(entry: Entry, call_id: str) -> bool:
    message = entry.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") == "tool_result" and b.get("tool_use_id") == call_id
        for b in content)


def _codex_result(entry: Entry, call_id: str) -> bool:
    payload = entry.get("payload")
    return entry.get("type") == "response_item" and isinstance(payload, dict) \
        and payload.get("type") in ("function_call_output", "custom_tool_call_output") \
        and payload.get("call_id") == call_id


def transcript_root(agent: str) -> str:
    """The directory where the agent keeps this user's transcripts (Claude Code:
    CLAUDE_CONFIG_DIR or ~/.claude, then projects/; Codex: CODEX_HOME or ~/.codex, then
    sessions/), as the daemon's environment (the user's, at mount time) names it."""
    from overlayckpt.agents.settings import qwen_home, user_settings_path
    if agent == "qwen":  # projects/<project>/chats/<session>.jsonl
        return os.path.join(os.environ.get("QWEN_RUNTIME_DIR") or qwen_home(), "projects")
    # beside the settings file we install the hooks in (gemini: tmp/<project>/chats/session-*.jsonl)
    sub = {"codex": "sessions", "gemini": "tmp"}.get(agent, "projects")
    return os.path.join(os.path.dirname(user_settings_path(agent)), sub)


class Transcript:
    """A transcript named by a conversation line (which the agent can forge), opened
    beneath its agent's transcript root one component at a time, never through a symlink:
    `dir_fd` holds it (the cut copy goes there), `fd` reads it. Close it when done."""

    def __init__(self, path: object, agent: str) -> None:
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

    def lines(self) -> TextIO:
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


def resume_command(lines: Lines) -> tuple[str, str] | None:
    """The agent transcript of a checkpoint's conversation (its lines, oldest first) cut
    back to it: (the command that resumes it, the copy's path); None if there is none.

    The newest line naming a transcript that exists decides; ValueError (saying why) if
    that transcript is not where its agent keeps them: a line may be forged by anyone who
    can write ctl, and nothing is read or written outside the agent's own directory."""
    for line in reversed(lines):
        path = line.get("transcript_path")
        agent = line.get("agent")
        if not isinstance(agent, str) or agent not in TRANSCRIPT_AGENTS or not path:
            continue
        try:
            transcript = Transcript(path, agent)
        except FileNotFoundError:
            continue  # gone (deleted by the agent or the user): an older one may remain
        try:
            call_id = line.get("tool_use_id") if line.get("event") in TOOL_EVENTS else None
            call = call_id if isinstance(call_id, str) else None
            if agent in ("gemini", "qwen"):
                mine = [x for x in lines if x.get("transcript_path") == path and x.get("agent") == agent]
                if agent == "gemini":
                    copy = cut_gemini_session(transcript, mine)
                    return f"gemini --session-file {copy}", copy
                session, copy = cut_qwen_session(transcript, mine)
                return f"qwen --resume {session}", copy
            if agent == "codex":
                session, copy = cut_codex_rollout(transcript, str(line["time"]), call)
                return f"codex resume {session}", copy
            copy = cut_transcript(transcript, str(line["time"]), call)
            return f"claude --resume {copy}", copy
        finally:
            transcript.close()
    return None


def _stamp(value: object) -> float | None:
    """An ISO 8601 time as seconds, None if it is not one."""
    import datetime
    if not isinstance(value, str):
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _records(transcript: Transcript) -> list[Record]:
    """A JSONL transcript's records (line as written, parsed), lines cut short skipped."""
    out = []
    with transcript.lines() as src:
        for line in src:
            try:
                entry: object = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict):
                out.append((line if line.endswith("\n") else line + "\n", entry))
    return out


def _cut(transcript: Transcript, until_iso: str, is_end: Callable[[Entry], bool]) -> list[Record]:
    """A JSONL transcript's records (line as written, parsed) through the first entry
    is_end accepts, or, if none does, those stamped no later than until_iso."""
    records = _records(transcript)
    end = next((i for i, (_, e) in enumerate(records) if is_end(e)), None)
    if end is not None:
        return records[:end + 1]
    until = _stamp(until_iso)
    if until is None:
        raise ValueError(f"{until_iso!r} is not a time")
    return _up_to(records, until)


def _up_to(records: list[Record], until: float,
           stamp: Callable[[Entry], float | None] = lambda e: _stamp(e.get("timestamp"))) -> list[Record]:
    """records before the first one stamp(entry) puts later than until (unstamped: kept)."""
    kept = []
    for line, entry in records:
        t = stamp(entry)
        if t is not None and t > until:
            break
        kept.append((line, entry))
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
    return transcript.write_copy(str(uuid.uuid4()) + ".jsonl", [line for line, _ in kept])


def cut_codex_rollout(rollout: Transcript, until_iso: str, call_id: str | None = None) -> tuple[str, str]:
    """Copy a Codex rollout up to a call's output (else a time) as a session of its own,
    beside it; returns (its id, its path). Codex finds a session by the id in its first
    line (session_meta) and in the file's name; `codex resume ID` works from any directory."""
    import uuid
    records = _cut(rollout, until_iso, lambda e: call_id is not None and _codex_result(e, call_id))
    kept = [line for line, _ in records]
    new_id = str(uuid.uuid4())
    old_id = None
    for i, (line, entry) in enumerate(records):
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


# --- transcripts without the hooks' call ids: Gemini CLI, qwen-code ----------------------

def _call_point(lines: Lines, done: list[float]) -> tuple[float, int, float] | None:
    """Where the last of lines (one agent session's, oldest first) stands, if it is a tool
    line: (the time of its call's PreToolUse line, k: that call is the k-th of its batch,
    the time of the last completion before it), done being the times the transcript
    records calls complete. The model asks for a batch after the previous one's results
    are back, so the batch's calls are the ones whose PreToolUse came after the last
    completion before this call's."""
    if not lines or lines[-1].get("event") not in TOOL_EVENTS:
        return None
    stamps = [_stamp(x.get("time")) for x in lines if x.get("event") == "PreToolUse"]
    starts = [t for t in stamps if t is not None]
    if not starts:
        return None
    at = starts[-1]
    since = max((t for t in done if t < at), default=float("-inf"))
    return at, sum(1 for t in starts if since < t <= at), since


def _until(lines: Lines) -> float:
    last = _stamp(lines[-1].get("time")) if lines else None
    return last if last is not None else float("inf")


def cut_gemini_session(session: Transcript, lines: Lines) -> str:
    """Copy a Gemini CLI session (JSONL: a metadata record, then message records, each a
    whole snapshot of its message, rewritten as tool calls complete) up to the point of
    lines, the checkpoint's lines of this session; returns the copy's path, beside it.

    Gemini records a batch of tool calls, with their results, once all of them are done,
    into its model message: the cut keeps that message with the calls up to the
    checkpoint's. Without a tool line, records up to the last line's time are kept. The
    copy's name is not a `session-` one, so Gemini's own list ignores it; `gemini
    --session-file COPY` imports it as a new session, in any directory."""
    import uuid
    records = _records(session)
    if not records or "sessionId" not in records[0][1]:
        raise ValueError(f"{os.path.basename(session.path)} is not a Gemini CLI session (JSONL)")

    def calls(entry: Entry) -> list[Entry]:
        found = entry.get("toolCalls")
        return [c for c in found if isinstance(c, dict)] if isinstance(found, list) else []
    done = [t for _, e in records for c in calls(e) if (t := _stamp(c.get("timestamp"))) is not None]
    point = _call_point(lines, done)
    kept: list[str] = []
    if point is not None:
        at, k, since = point
        for i, (_line, entry) in enumerate(records):
            batch = [c for c in calls(entry) if (_stamp(c.get("timestamp")) or since) > since]
            if not any((_stamp(c.get("timestamp")) or at) > at for c in batch):
                continue
            if 0 < k <= len(batch):  # this call and the batch's ones before it
                drop = {id(c) for c in batch[k:]}
                entry = dict(entry, toolCalls=[c for c in calls(entry) if id(c) not in drop])
                kept = [x for x, _ in records[:i]] + [json.dumps(entry, ensure_ascii=False) + "\n"]
            break
    if not kept:  # no tool line, or its call is not there: up to the line's time
        def latest(entry: Entry) -> float | None:
            times = [_stamp(entry.get("timestamp"))] + [_stamp(c.get("timestamp")) for c in calls(entry)]
            return max((t for t in times if t is not None), default=None)
        kept = [line for line, _ in _up_to(records, _until(lines), latest)]
    return session.write_copy(f"overlayckpt-{uuid.uuid4()}.jsonl", kept)


def cut_qwen_session(session: Transcript, lines: Lines) -> tuple[str, str]:
    """Copy a qwen-code session (JSONL records, each with uuid, parentUuid, sessionId,
    timestamp: the model's turn with its functionCall parts, then one tool_result record
    per call once the batch is done) up to the point of lines, as a session of its own
    beside it; returns (its id, its path). qwen finds a session by its file name,
    <id>.jsonl, in the project's chats directory: `qwen --resume ID` in the project.

    The cut keeps the model turn with the calls up to the checkpoint's and their results
    (qwen's hooks send a tool_use_id of their own, which the transcript does not name)."""
    import uuid
    records = _records(session)
    if not records or not all("sessionId" in e for _, e in records):
        raise ValueError(f"{os.path.basename(session.path)} is not a qwen-code session (JSONL)")

    def result_of(entry: Entry) -> str | None:
        result = entry.get("toolCallResult")
        if entry.get("type") == "tool_result" and isinstance(result, dict) and isinstance(result.get("callId"), str):
            return str(result["callId"])
        return None

    def parts(entry: Entry) -> list[object]:
        message = entry.get("message")
        found = message.get("parts") if isinstance(message, dict) else None
        return found if isinstance(found, list) else []

    def call_id(part: object) -> str | None:
        call = part.get("functionCall") if isinstance(part, dict) else None
        return str(call["id"]) if isinstance(call, dict) and isinstance(call.get("id"), str) else None

    done = [t for _, e in records if result_of(e) and (t := _stamp(e.get("timestamp"))) is not None]
    point = _call_point(lines, done)
    kept: list[Record] = []
    if point is not None:
        at, k, _since = point
        turns = [i for i, (_, e) in enumerate(records) if e.get("type") == "assistant"
                 and (_stamp(e.get("timestamp")) or at) <= at and any(call_id(p) for p in parts(e))]
        batch = [c for p in parts(records[turns[-1]][1]) if (c := call_id(p))] if turns else []
        if 0 < k <= len(batch):
            wanted, later = set(batch[:k]), set(batch[k:])
            end = next((i for i, (_, e) in enumerate(records) if result_of(e) == batch[k - 1]), None)
            if end is not None:
                for i, (line, entry) in enumerate(records[:end + 1]):
                    if i == turns[-1] and later:
                        message = entry["message"]  # a dict: parts(entry) found calls in it
                        assert isinstance(message, dict)
                        message = dict(message, parts=[p for p in parts(entry) if call_id(p) not in later])
                        entry = dict(entry, message=message)
                    elif i > turns[-1] and result_of(entry) and result_of(entry) not in wanted:
                        continue
                    kept.append((line, entry))
    if not kept:  # no tool line, or its call is not there: up to the line's time
        kept = _up_to(records, _until(lines))
    new_id = str(uuid.uuid4())
    text = [json.dumps(dict(entry, sessionId=new_id), ensure_ascii=False) + "\n" for _, entry in kept]
    return new_id, session.write_copy(f"{new_id}.jsonl", text)
