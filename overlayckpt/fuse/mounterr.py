"""Why a FUSE mount failed, as one line with what to do.

libfuse and fusermount3 tell the reason only on stderr; pyfuse3 then raises
`fuse_session_mount failed`. stderr_lines() captures what is written to fd 2
meanwhile (fusermount3 is libfuse's child and inherits it) and writes it on to
the real stderr (the daemon's log); reason() makes the line the user sees.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator

# (what libfuse or fusermount3 says, what to do); the first match wins
HINTS: tuple[tuple[str, str], ...] = (
    ("failed to open /dev/fuse: Permission denied",
     "/dev/fuse is not usable by you: 'sudo chmod 0666 /dev/fuse' (Debian's default), "
     "or mount as root"),
    ("/dev/fuse: No such file or directory",
     "this machine has no FUSE device: 'sudo modprobe fuse' (in a container: give it --device /dev/fuse)"),
    ("device not found", "this machine has no FUSE device: 'sudo modprobe fuse'"),
    ("user_allow_other",
     "add the line 'user_allow_other' to /etc/fuse.conf, or mount without --allow-other"),
    ("failed to exec fusermount3",
     "install fusermount3 ('sudo apt-get install fuse3'), or mount as root"),
    ("no write access to mountpoint", "mount on a directory you own"),
    ("not owned by user", "mount on a directory you own"),
    ("failed to access mountpoint", "create the mountpoint (a directory you own) first"),
    ("mount_max", "unmount other FUSE file systems, or raise mount_max in /etc/fuse.conf"),
    ("Operation not permitted",
     "the kernel refused the mount: fusermount3 must be setuid root "
     "('sudo chmod u+s /usr/bin/fusermount3'), or mount as root"),
    ("Device or resource busy", "something is mounted there already: unmount it or pick another mountpoint"),
)


@contextlib.contextmanager
def stderr_lines() -> Iterator[list[str]]:
    """The non-empty lines written to fd 2 inside the block (filled in when it ends)."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read()
            os.write(2, text)
            lines.extend(ln.strip() for ln in text.decode(errors="replace").splitlines() if ln.strip())


def reason(lines: list[str], fallback: str) -> str:
    """libfuse's or fusermount3's last word on the failure, then what to do about it."""
    said = [ln for ln in lines if ln.startswith(("fuse:", "fusermount"))] or lines
    for key, hint in HINTS:
        for line in said:
            if key in line:
                return f"{line}; {hint}"
    return said[-1] if said else fallback
