"""Unified diffs in git's format, so `git apply` accepts them (text and binary)."""
from __future__ import annotations

import difflib
import hashlib
import stat
import zlib

from overlayckpt.core.timeline import FileChange

_B85 = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz!#$%&()*+-;<=>?@^_`{|}~"


def _git_mode(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "120000"
    return "100755" if mode & stat.S_IXUSR else "100644"


def _is_binary(data: bytes) -> bool:
    return b"\0" in data[:8000]


def _b85_line(chunk: bytes) -> bytes:
    n = len(chunk)
    prefix = bytes([ord("A") + n - 1]) if n <= 26 else bytes([ord("a") + n - 27])
    padded = chunk + b"\0" * (-n % 4)
    out = bytearray()
    for i in range(0, len(padded), 4):
        acc = int.from_bytes(padded[i:i + 4], "big")
        chars = []
        for _ in range(5):
            acc, r = divmod(acc, 85)
            chars.append(_B85[r])
        out += bytes(reversed(chars))
    return prefix + bytes(out)


def _literal(data: bytes) -> str:
    packed = zlib.compress(data, 9)
    lines = [f"literal {len(data)}"]
    for i in range(0, len(packed), 52):
        lines.append(_b85_line(packed[i:i + 52]).decode())
    return "\n".join(lines) + "\n\n"


def _binary_patch(old: bytes, new: bytes) -> str:
    return "GIT binary patch\n" + _literal(new) + _literal(old)


def _blob_id(side: tuple[int, bytes] | None) -> str:
    """git's object id of a blob (binary patches need the full index line)."""
    if side is None:
        return "0" * 40
    return hashlib.sha1(b"blob %d\0" % len(side[1]) + side[1]).hexdigest()


def _range(start: int, length: int) -> str:
    if length == 1:
        return str(start + 1)
    if length == 0:
        return f"{start},0"
    return f"{start + 1},{length}"


def _hunks(a: list[bytes], b: list[bytes]) -> list[str]:
    out: list[str] = []

    def emit(tag: str, line: bytes) -> None:
        text = line.decode("utf-8", errors="surrogateescape")
        if text.endswith("\n"):
            out.append(tag + text)
        else:
            out.append(tag + text + "\n\\ No newline at end of file\n")

    for group in difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(3):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        out.append(f"@@ -{_range(i1, i2 - i1)} +{_range(j1, j2 - j1)} @@\n")
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                for line in a[a1:a2]:
                    emit(" ", line)
                continue
            for line in a[a1:a2]:
                emit("-", line)
            for line in b[b1:b2]:
                emit("+", line)
    return out


def render(changes: list[FileChange]) -> str:
    """A patch that turns the old tree into the new one."""
    parts: list[str] = []
    for c in changes:
        path = c.path
        head = [f"diff --git a/{path} b/{path}\n"]
        old_mode = _git_mode(c.old[0]) if c.old else None
        new_mode = _git_mode(c.new[0]) if c.new else None
        if c.old and c.new and old_mode != new_mode:
            if (old_mode == "120000") != (new_mode == "120000"):
                # a file became a symlink or back: git wants a delete and an add
                parts.append(render([FileChange(path, "D", c.old, None)]))
                parts.append(render([FileChange(path, "A", None, c.new)]))
                continue
            head += [f"old mode {old_mode}\n", f"new mode {new_mode}\n"]
        if c.old is None:
            head.append(f"new file mode {new_mode}\n")
        if c.new is None:
            head.append(f"deleted file mode {old_mode}\n")
        old = c.old[1] if c.old else b""
        new = c.new[1] if c.new else b""
        if old == new:
            parts.append("".join(head))
            continue
        if _is_binary(old) or _is_binary(new):
            head.append(f"index {_blob_id(c.old)}..{_blob_id(c.new)}\n")
            head.append(_binary_patch(old, new))
            parts.append("".join(head))
            continue
        head.append(f"--- {'a/' + path if c.old else '/dev/null'}\n")
        head.append(f"+++ {'b/' + path if c.new else '/dev/null'}\n")
        head += _hunks(old.splitlines(keepends=True), new.splitlines(keepends=True))
        parts.append("".join(head))
    return "".join(parts)


def stat_lines(changes: list[FileChange]) -> list[tuple[str, str, int, int]]:
    """(path, change, lines added, lines removed) per file."""
    out = []
    for c in changes:
        old = c.old[1].splitlines() if c.old else []
        new = c.new[1].splitlines() if c.new else []
        added = removed = 0
        for tag, a1, a2, b1, b2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
            if tag != "equal":
                removed += a2 - a1
                added += b2 - b1
        out.append((c.path, c.change, added, removed))
    return out
