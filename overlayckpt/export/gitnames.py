"""Names as git takes them: which file names, paths, modes and ref names can be exported,
C-style quoting of paths, and the session's name (the default branch's last part).
"""
from __future__ import annotations

import os
import re
import stat

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


def one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def person(name: str) -> str:
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
