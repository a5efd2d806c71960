"""Helpers of the security tier: hostile input must change nothing outside the repo and
the store, stay bounded, and get one clear line.

`surroundings(root, skip)` records everything observable under root (the test's whole
tmp_path, say: the repo's neighbours included) so a test can compare before and after.
"""
from __future__ import annotations

import os
import resource
import stat
import subprocess
from pathlib import Path

from conftest import tree_digest

_INTERNAL = ("Traceback", "Error:", "Exception", "errno", "mdb_", "struct.", "msgpack", "zstd")


def surroundings(root: Path, *skip: Path) -> dict[str, tuple]:
    """Every entry under root (type, mode, size, content, owner) but those under skip."""
    skipped = [str(p) for p in skip]
    out: dict[str, tuple] = {}
    for rel, what in tree_digest(str(root)).items():
        full = os.path.join(str(root), rel)
        if any(full == s or full.startswith(s + os.sep) for s in skipped):
            continue
        st = os.lstat(full)
        out[rel] = (*what, st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode))
    return out


def assert_one_line(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    """A refused command: status 1, one line on stderr naming no internal exception, holding words."""
    err = proc.stderr.strip()
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert err and "\n" not in err, err
    assert not any(w in err for w in _INTERNAL), err
    for w in words:
        assert w in err, (w, err)
    return err


def child_peak_rss_mb() -> float:
    """The largest resident size any waited-for child reached so far, in MB."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
