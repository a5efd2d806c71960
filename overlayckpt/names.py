"""Untrusted names and text: the one place that says what a file name, a checkpoint
name and a checkpoint id may be, and how user-controlled text is shown on a terminal.

Everything here is pure (no I/O) and sits at the bottom layer, so the places where
input enters (import, ctl, the CLI, MCP, hooks) and the places where it touches the
disk (apply, views, export) check with the same rules.
"""
from __future__ import annotations

import re

from overlayckpt.errors import UserError

NAME_MAX = 255  # bytes in a name, as Linux file systems allow (records.py uses this one)
CHECKPOINT_NAME_MAX = 64  # characters of a checkpoint name
_ID = re.compile(r"[0-9]{1,18}")  # ASCII digits only: "１" or "²" are not ids


def is_file_name(name: bytes) -> bool:
    """One path component that is safe to create beneath a directory fd."""
    return (isinstance(name, bytes) and 0 < len(name) <= NAME_MAX and name not in (b".", b"..")
            and b"/" not in name and b"\0" not in name)


def check_file_name(name: bytes, where: str) -> bytes:
    """name, or UserError saying where it came from (a bundle, a session)."""
    if not is_file_name(name):
        raise UserError(f"{where} holds the file name {quote_path(name)}, which is not a single "
                        "path component: it is refused, nothing was written")
    return name


def parse_id(ref: str) -> int | None:
    """A checkpoint id written as ASCII digits, else None (then ref is a name)."""
    return int(ref) if _ID.fullmatch(ref) else None


def parse_ref(ref: str) -> int | str:
    """A checkpoint as the CLI and MCP read it: an id when ASCII digits, else a name."""
    cid = parse_id(ref)
    return ref if cid is None else cid


def checkpoint_name_problem(name: str) -> str | None:
    """Why name cannot name a checkpoint, or None when it can."""
    if not name:
        return "it is empty"
    if len(name) > CHECKPOINT_NAME_MAX:
        return f"it is longer than {CHECKPOINT_NAME_MAX} characters"
    if any(0xD800 <= ord(c) <= 0xDFFF for c in name):
        return "it is not valid Unicode"
    if not name.isprintable() or any(c.isspace() for c in name):
        return "it holds a space or a character that cannot be printed"
    if name in (".", "..") or "/" in name:
        return "it is '.', '..' or holds '/'"
    if name[0] in "-@":
        return "it starts with '-' or '@'"
    if name.isdecimal() or name.isdigit() or name.isnumeric():
        return "it is a number, which would read as a checkpoint id"
    return None


def check_checkpoint_name(name: str) -> str:
    why = checkpoint_name_problem(name)
    if why is not None:
        raise UserError(f"bad checkpoint name {shown(name)}: {why}; use letters, digits, "
                        "'-', '_' and '.', starting with a letter or digit")
    return name


MESSAGE_MAX = 1 << 16  # characters of a checkpoint's message


def check_message(message: str) -> str:
    """A checkpoint's message: free text (shown escaped), but valid Unicode and bounded."""
    if len(message) > MESSAGE_MAX:
        raise UserError(f"checkpoint message longer than {MESSAGE_MAX} characters: shorten it")
    if "\0" in message or any(0xD800 <= ord(c) <= 0xDFFF for c in message):
        raise UserError("checkpoint message holds a NUL character or invalid Unicode: "
                        "write it as plain text")
    return message


_GIT_ESCAPES = {0x07: "a", 0x08: "b", 0x09: "t", 0x0A: "n", 0x0B: "v", 0x0C: "f", 0x0D: "r",
                0x22: '"', 0x5C: "\\"}


def quote_path(path: bytes | str) -> str:
    """A path as git shows it: as is when every character is printable, else C-quoted in
    double quotes with octal escapes (what `git apply` and a terminal both take safely)."""
    raw = path if isinstance(path, bytes) else path.encode("utf-8", "surrogateescape")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and text.isprintable() and '"' not in text and "\\" not in text:
        return text
    out = ['"']
    i = 0
    while i < len(raw):
        c = raw[i]
        if c in _GIT_ESCAPES:
            out.append("\\" + _GIT_ESCAPES[c])
        elif c < 0x20 or c == 0x7F:
            out.append(f"\\{c:03o}")
        elif c < 0x80:
            out.append(chr(c))
        else:  # a UTF-8 sequence: kept when it is one printable character, else octal
            n = 2 if c >> 5 == 0b110 else 3 if c >> 4 == 0b1110 else 4 if c >> 3 == 0b11110 else 1
            seq = raw[i:i + n]
            try:
                ch = seq.decode("utf-8")
            except UnicodeDecodeError:
                ch = ""
            if len(seq) == n and ch.isprintable() and ch:
                out.append(ch)
                i += n
                continue
            out.append(f"\\{c:03o}")
        i += 1
    out.append('"')
    return "".join(out)


SHOWN_MAX = 80  # characters of a value quoted in a message (a 1 MiB name stays one line)


def shown(text: object) -> str:
    """A value for a one-line message: repr-like, so nothing in it reaches the terminal raw,
    and cut short when long."""
    if not isinstance(text, str):  # (a number as itself: unknown checkpoint 999)
        value = repr(text)
        return value if len(value) <= SHOWN_MAX else value[:SHOWN_MAX] + "..."
    if len(text) > SHOWN_MAX:
        return repr(text[:SHOWN_MAX]) + "..."
    return repr(text)  # repr escapes what is not printable


def line_text(text: str) -> str:
    """One-line text (a summary, a name, a process name) for a terminal: every character
    that is not printable escaped, newlines and tabs too."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape_char(c) for c in text)


def name_key(ref: str) -> bytes | None:
    """The stored key of checkpoint name ref, or None when no name could be stored under it
    (empty, not encodable, longer than a key): such a ref names no checkpoint."""
    try:
        key = ref.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return key if 0 < len(key) <= 511 else None


def terminal_text(text: str) -> str:
    """Multi-line text (a message, a conversation line) with every character a terminal
    would act on escaped; newlines and tabs are kept."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else _escape_char(c) for c in text)


def _escape_char(c: str) -> str:
    o = ord(c)
    if c in "\n\t\r":
        return {"\n": "\\n", "\t": "\\t", "\r": "\\r"}[c]
    if 0xDC80 <= o <= 0xDCFF:  # a byte of a name that is not UTF-8 (surrogateescape): as the byte
        return f"\\x{o - 0xDC00:02x}"
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"
