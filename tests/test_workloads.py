"""Real tools inside the mount, each compared with the same workload on a native copy.

Every test works on the `mounted` sample repo and on `native`, a `cp -a` copy of
the same repo in a plain directory, runs the same commands in both and compares
what the tools print and what they leave behind.
"""
from __future__ import annotations

import os
import shutil
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Mount, tree_digest
from helpers_diff import run, unmount

# cp -a, cp -p, sed -i (gnulib's copy_acl/qset_acl) set a copy's mode with
# fsetxattr("system.posix_acl_access") first; the daemon refuses it with EOPNOTSUPP
# so that the tools fall back to fchmod (the tests below check the modes).


@pytest.fixture
def native(mounted: Mount, tmp_path: Path) -> Path:
    dst = tmp_path / "native"
    subprocess.run(["cp", "-a", str(mounted.repo), str(dst)], check=True)
    assert tree_digest(str(dst)) == tree_digest(str(mounted.mnt))
    return dst


def worktree(root: Path, skip: tuple[str, ...] = (".git",), modes: bool = True) -> dict[str, tuple]:
    """tree_digest without the entries under `skip` (git's index holds inode numbers and times);
    without modes if `modes` is false."""
    out = {k: v for k, v in tree_digest(str(root)).items()
           if not any(k == s or k.startswith(s + "/") for s in skip)}
    if not modes:
        out = {k: (v[0],) + v[2:] if v[0] in "fd" else v for k, v in out.items()}
    return out


def assert_same_tree(native: Path, mnt: Path, skip: tuple[str, ...] = (".git",), modes: bool = True) -> None:
    want, got = worktree(native, skip, modes), worktree(mnt, skip, modes)
    diff = {k: (want.get(k), got.get(k)) for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)}
    assert not diff, f"trees differ (path: (native, mount)): {diff}"


def both(cmd: list[str], native: Path, mnt: Path, check: bool = True) -> str:
    """Run cmd in both trees; stdout, stderr and exit status must match. Returns stdout."""
    a = run(cmd, cwd=native, check=check)
    b = run(cmd, cwd=mnt, check=check)

    def norm(s: str, root: Path) -> str:
        return s.replace(str(root), "ROOT")
    assert (b.returncode, norm(b.stdout, mnt)) == (a.returncode, norm(a.stdout, native)), (
        f"{cmd}: mount gave {b.returncode} {b.stdout!r} {b.stderr!r}, "
        f"native gave {a.returncode} {a.stdout!r} {a.stderr!r}")
    return a.stdout


# -- git ---------------------------------------------------------------------


def test_git_lifecycle(mounted: Mount, native: Path) -> None:
    mnt = mounted.mnt
    for root in (native, mnt):
        run(["git", "init", "-q", "-b", "main"], cwd=root)
    both(["git", "add", "-A"], native, mnt)
    both(["git", "commit", "-q", "-m", "first"], native, mnt)
    assert both(["git", "status", "--porcelain"], native, mnt) == ""
    first = both(["git", "rev-parse", "HEAD"], native, mnt).strip()

    for root in (native, mnt):
        (root / "src" / "pkg" / "util.py").write_text("def answer():\n    return 43\n")
        (root / "src" / "new.py").write_text("NEW = 1\n")
        os.unlink(root / "bin.dat")
    assert both(["git", "status", "--porcelain"], native, mnt) == (
        " D bin.dat\n M src/pkg/util.py\n?? src/new.py\n")
    both(["git", "add", "-A"], native, mnt)
    both(["git", "commit", "-q", "-m", "second"], native, mnt)
    second = both(["git", "rev-parse", "HEAD"], native, mnt).strip()
    assert first != second
    assert both(["git", "log", "--format=%H %s"], native, mnt) == f"{second} second\n{first} first\n"

    # back to the first commit and forward again
    both(["git", "checkout", "-q", first], native, mnt)
    assert (mnt / "bin.dat").read_bytes() == (mounted.repo / "bin.dat").read_bytes()
    assert not (mnt / "src" / "new.py").exists()
    assert both(["git", "status", "--porcelain"], native, mnt) == ""
    assert_same_tree(native, mnt)
    both(["git", "checkout", "-q", "main"], native, mnt)
    assert "return 43" in (mnt / "src" / "pkg" / "util.py").read_text()
    assert both(["git", "status", "--porcelain"], native, mnt) == ""
    assert_same_tree(native, mnt)

    # stash and pop
    for root in (native, mnt):
        with open(root / "README.md", "a") as f:
            f.write("stashed line\n")
    both(["git", "stash", "-q"], native, mnt)
    assert both(["git", "status", "--porcelain"], native, mnt) == ""
    assert "stashed line" not in (mnt / "README.md").read_text()
    both(["git", "stash", "pop", "-q"], native, mnt)
    assert "stashed line" in (mnt / "README.md").read_text()
    # README.md and hardlink.md are one file (a hard link in the sample repo)
    assert both(["git", "status", "--porcelain"], native, mnt) == " M README.md\n M hardlink.md\n"
    assert_same_tree(native, mnt)

    # gc packs everything, then the repository is still whole
    both(["git", "gc", "-q", "--aggressive", "--prune=now"], native, mnt)
    both(["git", "fsck", "--full", "--strict"], native, mnt)
    assert both(["git", "count-objects", "-v"], native, mnt).count("count: 0") == 1
    assert both(["git", "log", "--format=%H %s"], native, mnt) == f"{second} second\n{first} first\n"
    both(["git", "diff", "--stat"], native, mnt)
    assert_same_tree(native, mnt)


def test_git_status_sees_edits_made_in_the_same_second(mounted: Mount) -> None:
    """Racy-git: an edit that keeps the size must still show in `git status`."""
    mnt = mounted.mnt
    run(["git", "init", "-q", "-b", "main"], cwd=mnt)
    run(["git", "add", "-A"], cwd=mnt)
    run(["git", "commit", "-q", "-m", "c"], cwd=mnt)
    p = mnt / "src" / "pkg" / "util.py"
    p.write_text(p.read_text().replace("42", "24"))
    assert run(["git", "status", "--porcelain"], cwd=mnt).stdout == " M src/pkg/util.py\n"
    run(["git", "checkout", "--", "src/pkg/util.py"], cwd=mnt)
    assert "42" in p.read_text()
    assert run(["git", "status", "--porcelain"], cwd=mnt).stdout == ""


# -- editors and stream tools -----------------------------------------------


def test_sed_in_place(mounted: Mount, native: Path) -> None:
    """Contents and links after `sed -i` (modes: see test_sed_in_place_keeps_mode)."""
    mnt = mounted.mnt
    both(["sed", "-i", "s/42/4242/", "src/pkg/util.py"], native, mnt)
    assert (mnt / "src" / "pkg" / "util.py").read_text() == "def answer():\n    return 4242\n"
    # sed -i on one name of a hard-linked pair replaces that name only
    both(["sed", "-i", "s/hello/bye/", "README.md"], native, mnt)
    assert (mnt / "README.md").read_text() == "# demo\n\nbye\n"
    assert (mnt / "hardlink.md").read_text() == "# demo\n\nhello\n"
    assert os.stat(mnt / "hardlink.md").st_nlink == 1
    # sed -i through a symlink with --follow-symlinks edits the target
    both(["sed", "-i", "--follow-symlinks", "s/demo/DEMO/", "link"], native, mnt)
    assert os.readlink(mnt / "link") == "README.md"
    assert (mnt / "README.md").read_text() == "# DEMO\n\nbye\n"
    both(["sed", "-i", "s/line/LINE/g", "docs/guide.txt"], native, mnt)
    both(["sed", "-i", "s/run/ran/", "run.sh"], native, mnt)
    assert_same_tree(native, mnt, modes=False)
    assert not [n for n in os.listdir(mnt) if n.startswith("sed")]


def test_sed_in_place_keeps_mode(mounted: Mount, native: Path) -> None:
    both(["sed", "-i", "s/run/ran/", "run.sh"], native, mounted.mnt)
    both(["sed", "-i", "s/42/4242/", "src/pkg/util.py"], native, mounted.mnt)
    assert stat.S_IMODE(os.stat(mounted.mnt / "src" / "pkg" / "util.py").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(mounted.mnt / "run.sh").st_mode) == 0o755
    assert run(["./run.sh"], cwd=mounted.mnt).stdout == "ran\n"
    assert_same_tree(native, mounted.mnt)


def _atomic_save(root: Path, rel: str, content: bytes) -> None:
    """What editors do: write a temp file next to the target, fsync, rename over it."""
    target = root / rel
    tmp = target.with_name(f".{target.name}.tmp-save")
    mode = stat.S_IMODE(os.stat(target).st_mode)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, content)
        os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, target)
    dfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def test_editor_atomic_save(mounted: Mount, native: Path, mount_factory) -> None:
    mnt = mounted.mnt
    old_fd = os.open(mnt / "src" / "main.py", os.O_RDONLY)
    try:
        for i in range(20):
            for root in (native, mnt):
                _atomic_save(root, "src/main.py", f"print({i})\n".encode() * (i + 1))
                _atomic_save(root, "run.sh", f"#!/bin/sh\necho {i}\n".encode())
            assert (mnt / "src" / "main.py").read_bytes() == f"print({i})\n".encode() * (i + 1)
        # a reader that opened the file before the saves still sees the old file
        assert os.pread(old_fd, 100, 0) == b"import pkg.util\nprint(pkg.util.answer())\n"
    finally:
        os.close(old_fd)
    assert stat.S_IMODE(os.stat(mnt / "run.sh").st_mode) == 0o755
    assert subprocess.run([str(mnt / "run.sh")], capture_output=True, text=True).stdout == "19\n"
    assert not [n for n in os.listdir(mnt / "src") if n.startswith(".")]
    assert_same_tree(native, mnt)
    unmount(mnt)
    m = mount_factory(mounted.repo)
    assert_same_tree(native, m.mnt)


# -- python ------------------------------------------------------------------


def test_python_writes_and_imports_module(mounted: Mount, native: Path) -> None:
    mnt = mounted.mnt
    for root in (native, mnt):
        (root / "src" / "fresh_mod.py").write_text("VALUE = 'v1'\n")
    cmd = [sys.executable, "-c", "import fresh_mod, pkg.util; print(fresh_mod.VALUE, pkg.util.answer())"]
    assert both(cmd, native / "src", mnt / "src") == "v1 42\n"
    assert (mnt / "src" / "__pycache__").is_dir()
    assert sorted(os.listdir(mnt / "src" / "__pycache__")) == sorted(os.listdir(native / "src" / "__pycache__"))
    # an edit (other size) is picked up, not a stale .pyc
    for root in (native, mnt):
        (root / "src" / "fresh_mod.py").write_text("VALUE = 'version two'\n")
    assert both(cmd, native / "src", mnt / "src") == "version two 42\n"
    assert both([sys.executable, "main.py"], native / "src", mnt / "src") == "42\n"
    # compileall and running a package with -m
    both([sys.executable, "-m", "compileall", "-q", "."], native / "src", mnt / "src")
    assert_same_tree(native, mnt, skip=("src/__pycache__", "src/pkg/__pycache__"))
    assert sorted(os.listdir(mnt / "src" / "pkg" / "__pycache__")) == sorted(
        os.listdir(native / "src" / "pkg" / "__pycache__"))


# -- sqlite --------------------------------------------------------------------


def _sqlite_workload(path: Path, journal_mode: str) -> list:
    out: list = []
    con = sqlite3.connect(path, isolation_level=None)
    try:
        out.append(con.execute(f"PRAGMA journal_mode={journal_mode}").fetchone()[0])
        con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, body TEXT)")
        con.execute("BEGIN")
        for i in range(500):
            con.execute("INSERT INTO t (body) VALUES (?)", (f"row {i} " * 20,))
        con.execute("COMMIT")
        con.execute("BEGIN")
        con.execute("DELETE FROM t WHERE id % 2 = 0")
        con.execute("INSERT INTO t (body) VALUES ('rolled back')")
        con.execute("ROLLBACK")
        out.append(con.execute("SELECT count(*), sum(length(body)) FROM t").fetchone())
        con.execute("BEGIN")
        con.execute("UPDATE t SET body = 'updated' WHERE id <= 10")
        con.execute("COMMIT")
    finally:
        con.close()
    con = sqlite3.connect(path)
    try:
        out.append(con.execute("PRAGMA integrity_check").fetchone()[0])
        out.append(con.execute("SELECT count(*), sum(length(body)) FROM t").fetchone())
        out.append(con.execute("SELECT body FROM t WHERE id IN (1, 11) ORDER BY id").fetchall())
        con.execute("VACUUM")
        out.append(con.execute("SELECT count(*) FROM t").fetchone())
    finally:
        con.close()
    return out


@pytest.mark.parametrize("journal_mode", ["delete", "wal"])
def test_sqlite_transactions(mounted: Mount, native: Path, journal_mode: str, mount_factory) -> None:
    want = _sqlite_workload(native / "db.sqlite", journal_mode)
    got = _sqlite_workload(mounted.mnt / "db.sqlite", journal_mode)
    assert got == want
    assert want[1] == (500, sum(len(f"row {i} " * 20) for i in range(500)))
    unmount(mounted.mnt)
    m = mount_factory(mounted.repo)
    con = sqlite3.connect(m.mnt / "db.sqlite")
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert con.execute("SELECT count(*) FROM t").fetchone() == (500,)
    finally:
        con.close()


def test_sqlite_cli_two_processes(mounted: Mount) -> None:
    """One process writes, another reads the committed rows (file locks across processes)."""
    if shutil.which("sqlite3") is None:
        pytest.skip("no sqlite3 command")
    db = mounted.mnt / "shared.db"
    run(["sqlite3", str(db), "CREATE TABLE k (v INTEGER); INSERT INTO k VALUES (1), (2), (3);"],
        cwd=mounted.mnt)
    con = sqlite3.connect(db)
    try:
        assert con.execute("SELECT sum(v) FROM k").fetchone() == (6,)
        con.execute("INSERT INTO k VALUES (4)")
        con.commit()
    finally:
        con.close()
    out = run(["sqlite3", str(db), "SELECT sum(v) FROM k;"], cwd=mounted.mnt).stdout
    assert out == "10\n"


# -- archives, copies, removal -----------------------------------------------


def _make_archive(tmp_path: Path) -> Path:
    src = tmp_path / "archive-src"
    (src / "a" / "b" / "c").mkdir(parents=True)
    (src / "a" / "b" / "c" / "deep.txt").write_text("deep\n")
    (src / "exe").write_bytes(b"#!/bin/sh\necho exe\n")
    os.chmod(src / "exe", 0o751)
    (src / "ro.txt").write_text("read only\n")
    os.chmod(src / "ro.txt", 0o444)
    (src / "big.bin").write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    (src / "empty-file").write_bytes(b"")
    (src / "emptydir").mkdir()
    os.symlink("a/b/c/deep.txt", src / "sym")
    os.symlink("nowhere", src / "dangling")
    os.link(src / "ro.txt", src / "ro-link.txt")
    os.chmod(src / "a" / "b", 0o750)
    archive = tmp_path / "archive.tar.gz"
    subprocess.run(["tar", "-C", str(src), "-czf", str(archive), "."], check=True)
    return archive


def test_tar_extract(mounted: Mount, native: Path, tmp_path: Path) -> None:
    archive = _make_archive(tmp_path)
    for root in (native, mounted.mnt):
        (root / "x").mkdir()
        run(["tar", "-xzf", str(archive)], cwd=root / "x")
    assert_same_tree(native, mounted.mnt)
    assert os.stat(mounted.mnt / "x" / "ro.txt").st_nlink == 2
    # extract again over the existing files (tar unlinks and recreates)
    for root in (native, mounted.mnt):
        run(["tar", "-xzf", str(archive)], cwd=root / "x")
    assert_same_tree(native, mounted.mnt)
    # and a tar of the mount has the same content as a tar of the native tree
    listings = []
    for root in (native, mounted.mnt):
        out = tmp_path / f"again-{root.name}"
        out.mkdir()
        subprocess.run(f"tar -C {root} -cf - . | tar -C {out} -xf -", shell=True, check=True)
        listings.append(worktree(out))
    assert listings[0] == listings[1]


def test_gcc_compile_and_run(mounted: Mount, native: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    src = ('#include <stdio.h>\n#include "answer.h"\n'
           'int main(void) { printf("answer=%d\\n", ANSWER); return 0; }\n')
    for root in (native, mounted.mnt):
        (root / "c").mkdir()
        (root / "c" / "answer.h").write_text("#define ANSWER 42\n")
        (root / "c" / "main.c").write_text(src)
    both(["gcc", "-O1", "-c", "main.c", "-o", "main.o"], native / "c", mounted.mnt / "c")
    both(["gcc", "main.o", "-o", "prog"], native / "c", mounted.mnt / "c")
    assert os.stat(mounted.mnt / "c" / "prog").st_mode & 0o111
    assert both(["./prog"], native / "c", mounted.mnt / "c") == "answer=42\n"
    # rebuild after an edit: the new binary replaces the one that just ran
    for root in (native, mounted.mnt):
        (root / "c" / "answer.h").write_text("#define ANSWER 7\n")
    both(["gcc", "-O1", "main.c", "-o", "prog"], native / "c", mounted.mnt / "c")
    assert both(["./prog"], native / "c", mounted.mnt / "c") == "answer=7\n"
    assert (mounted.mnt / "c" / "main.o").read_bytes() == (native / "c" / "main.o").read_bytes()


def test_cp_a_inside_mount(mounted: Mount, native: Path) -> None:
    both(["cp", "-a", "src", "src-copy"], native, mounted.mnt)
    both(["cp", "-a", "run.sh", "run-copy.sh"], native, mounted.mnt)
    assert_same_tree(native, mounted.mnt)


def test_cp_p_single_file_keeps_mode(mounted: Mount) -> None:
    run(["cp", "-p", "run.sh", "run-copy.sh"], cwd=mounted.mnt)
    assert stat.S_IMODE(os.stat(mounted.mnt / "run-copy.sh").st_mode) == 0o755


def test_cp_r_inside_mount(mounted: Mount, native: Path) -> None:
    """A plain recursive copy (modes from open/mkdir, no ACL calls)."""
    both(["cp", "-r", "--no-preserve=all", "src", "src-copy"], native, mounted.mnt)
    assert_same_tree(native, mounted.mnt)


def test_cp_a_out_of_mount(mounted: Mount, tmp_path: Path) -> None:
    """Copying the mounted tree out (reads, readlink, xattrs, hard links) gives the repo."""
    os.setxattr(mounted.mnt / "README.md", "user.note", b"kept")
    out = tmp_path / "copied-out"
    subprocess.run(["cp", "-a", str(mounted.mnt), str(out)], check=True)
    want = tree_digest(str(mounted.mnt))
    assert tree_digest(str(out)) == want
    assert os.getxattr(out / "hardlink.md", "user.note") == b"kept"
    assert ".overlayckpt" not in os.listdir(out)


def test_cp_a_into_mount_from_outside(mounted: Mount, native: Path, tmp_path: Path) -> None:
    """cp -a of an outside tree into the mount keeps modes, links, symlinks and contents."""
    archive = _make_archive(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    subprocess.run(["tar", "-C", str(outside), "-xzf", str(archive)], check=True)
    for root in (native, mounted.mnt):
        subprocess.run(["cp", "-a", str(outside), str(root / "imported")], check=True)
    assert_same_tree(native, mounted.mnt)


def test_rm_rf_subtree(mounted: Mount, native: Path) -> None:
    mnt = mounted.mnt
    for root in (native, mnt):
        (root / "src" / "pkg" / "new").mkdir()
        (root / "src" / "pkg" / "new" / "f.txt").write_text("f\n")
        os.symlink("../main.py", root / "src" / "pkg" / "sl")
        os.chmod(root / "src" / "pkg" / "new", 0o555)
    both(["rm", "-rf", "src"], native, mnt)
    assert not (mnt / "src").exists()
    assert "src" not in os.listdir(mnt)
    assert_same_tree(native, mnt)
    # the name is free again, and nothing of the lower shows through
    both(["mkdir", "-p", "src/pkg"], native, mnt)
    assert os.listdir(mnt / "src" / "pkg") == []
    both(["rm", "-rf", "docs", "empty", "link", "bin.dat"], native, mnt)
    assert_same_tree(native, mnt)
    assert sorted(os.listdir(mnt)) == sorted(os.listdir(native))
    # the repo below is untouched (the fixture also checks this at the end)
    assert (mounted.repo / "src" / "main.py").exists()


def test_find_and_grep_over_tree(mounted: Mount, native: Path) -> None:
    assert both(["sh", "-c", "find . | sort"], native, mounted.mnt)
    assert both(["grep", "-rn", "answer", "."], native, mounted.mnt)
    both(["sh", "-c", "find . -type f -print0 | sort -z | xargs -0 sha256sum"], native, mounted.mnt)
