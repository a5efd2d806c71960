"""What is written to conversation.jsonl, made into the line the conversation stores.

A writer (an agent's hook, or anyone who can write the control directory) sends either
a conversation line ({"role": ..., "content": ...}) or an agent's hook event wrapped as
{"hook": AGENT, "event": EVENT} (agents/hooks.py: the hooks write events as they came,
and their lines are made here). Everything in it is foreign JSON: checked before use.
core/conversation.py stores the result.
"""
from __future__ import annotations

import json
import re

from overlayckpt.agents.hooks import MAX_HOOK_LINE, hook_line
from overlayckpt.errors import UserError
from overlayckpt.messages import ConversationLine

MAX_LINE = 1 << 20
_SURROGATE = re.compile("[\ud800-\udfff]")  # (json.loads has joined every pair)


def parse_line(line: bytes) -> ConversationLine | None:
    """A conversation line as written to the sidecar, or an agent's hook event wrapped
    as {"hook": AGENT, "event": EVENT}; None: a hook event that logs nothing."""
    if len(line) > MAX_HOOK_LINE:
        raise UserError(f"conversation line longer than {MAX_HOOK_LINE} bytes")
    try:
        obj: object = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"conversation line is not JSON: {e}") from None
    except RecursionError:
        raise UserError("conversation line is not JSON: nesting too deep") from None
    if isinstance(obj, dict) and "hook" in obj and "role" not in obj:
        try:
            obj = hook_line(obj)
        except ValueError as e:
            raise UserError(str(e)) from None
        if obj is None:
            return None
        # the limit on the line itself, as when the hook wrote the line it made
        line = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
    if len(line) > MAX_LINE:
        raise UserError(f"conversation line longer than {MAX_LINE} bytes")
    if not isinstance(obj, dict) or not isinstance(obj.get("role"), str) or "content" not in obj:
        raise UserError('a conversation line is a JSON object with "role" (string) and "content"')
    return {_whole_str(k): _whole_text(v) for k, v in obj.items()}


def _whole_str(value: str) -> str:
    """value with every lone surrogate ("\\ud800": JSON allows it, UTF-8 cannot hold it; an
    agent's tool output cut inside an emoji has one) replaced by U+FFFD, so the line is
    stored as sent but for that character rather than refused."""
    return value if value.isascii() else _SURROGATE.sub("\ufffd", value)


def _whole_text(value: object) -> object:
    """value (parsed JSON) with _whole_str applied to every string in it, keys included."""
    if isinstance(value, str):
        return _whole_str(value)
    if isinstance(value, dict):
        return {_whole_text(k): _whole_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_text(v) for v in value]
    return value
