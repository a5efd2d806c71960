"""Checkpoints against an oracle: every recorded tree restores exactly."""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import Mount, force_unmount, run_cli, tree_digest, wait_daemon_gone


def _step(rng: random.Random, root: Path, i: int) -> None:
    """One random edit of the kind an agent makes, through files or the shell."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()
                   and ".overlayckpt" not in p.parts)
    dirs = sorted(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()
                  and ".overlayckpt" not in p.parts)
    op = rng.choice(["write", "append", "create", "delete", "rename", "chmod", "symlink",
                     "mkdir", "rmdir", "sed", "truncate", "shell"])
    if op in ("write", "append", "sed", "truncate", "chmod", "delete", "rename") and not files:
        op = "create"
    if op == "write":
        f = rng.choice(files)
        with open(f, "r+b") as fh:
            fh.seek(rng.randrange(0, max(1, f.stat().st_size)))
            fh.write(f"edit {i}\n".encode() * rng.randrange(1, 2000))
    elif op == "append":
        with open(rng.choice(files), "a") as fh:
            fh.write(f"appended {i}\n")
    elif op == "create":
        d = rng.choice([root] + dirs)
        (d / f"new{i}.txt").write_text(f"new file {i}\n" * rng.randrange(1, 50))
    elif op == "delete":
        rng.choice(files).unlink()
    elif op == "rename":
        f = rng.choice(files)
        f.rename(rng.choice([root] + dirs) / f"moved{i}")
    elif op == "chmod":
        rng.choice(files).chmod(rng.choice([0o600, 0o644, 0o755]))
    elif op == "symlink":
        (rng.choice([root] + dirs) / f"link{i}").symlink_to(f"target{i}")
    elif op == "mkdir":
        (rng.choice([root] + dirs) / f"dir{i}").mkdir()
    elif op == "rmdir":
        if dirs:
            d = rng.choice(dirs)
            shutil.rmtree(d)
    elif op == "sed":
        f = rng.choice(files)
        subprocess.run(["sed", "-i", "s/e/E/", str(f)], check=True)
    elif op == "truncate":
        os.truncate(rng.choice(files), rng.randrange(0, 3000))
    elif op == "shell":
        d = rng.choice([root] + dirs)
        subprocess.run(f"mkdir -p sh{i}/a && echo {i} > sh{i}/a/f && cp -r sh{i} sh{i}b",
                       shell=True, cwd=d, check=True)


def _checkpoint(m: Mount) -> int:
    return int(m.cli("checkpoint").stdout.strip())


@pytest.mark.parametrize("seed", [1, 2])
def test_every_checkpoint_restores_exactly(repo: Path, mount_factory, seed: int) -> None:
    m = mount_factory(repo)
    rng = random.Random(seed)
    recorded: dict[int, dict] = {_checkpoint(m): tree_digest(str(m.mnt))}
    for i in range(25):
        _step(rng, m.mnt, i)
        recorded[_checkpoint(m)] = tree_digest(str(m.mnt))
    final = tree_digest(str(m.mnt))
    order = list(recorded)
    rng.shuffle(order)
    for cid in order:
        m.cli("restore", str(cid))
        assert tree_digest(str(m.mnt)) == recorded[cid], f"checkpoint {cid} did not restore exactly"
    last = max(recorded)
    m.cli("restore", str(last))
    assert tree_digest(str(m.mnt)) == final


def test_auto_checkpoints_capture_shell_changes(repo: Path, mount_factory) -> None:
    m = mount_factory(repo, "--window", "0")
    before = tree_digest(str(m.mnt))
    subprocess.run(["sed", "-i", "s/hello/bye/", str(m.mnt / "README.md")], check=True)
    subprocess.run(["rm", "-rf", str(m.mnt / "src")], check=True)
    log = m.ctl({"cmd": "log"})["checkpoints"]
    kinds = {c["kind"] for c in log}
    assert kinds == {"auto"}
    comms = {c["process"]["comm"] for c in log}
    assert {"sed", "rm"} <= comms
    first_change = min(c["id"] for c in log if c["id"] > 0)
    m.cli("restore", str(first_change - 1))
    assert tree_digest(str(m.mnt)) == before


def test_grouping_window_makes_one_checkpoint_per_burst(repo: Path, mount_factory) -> None:
    m = mount_factory(repo, "--window", "30")
    subprocess.run("for i in $(seq 50); do echo $i > f$i; done", shell=True, cwd=m.mnt, check=True)
    log = m.ctl({"cmd": "log"})["checkpoints"]
    bursts = [c for c in log if c["id"] > 0]
    assert len(bursts) == 1
    assert len(bursts[0]["files"]) == 50
    assert all(f["change"] == "A" for f in bursts[0]["files"])


def test_named_checkpoint_diff_show_and_git_apply(repo: Path, mount_factory, tmp_path: Path) -> None:
    m = mount_factory(repo)
    base = m.cli("checkpoint", "base", "-m", "start").stdout.strip()
    (m.mnt / "README.md").write_text("# demo\n\nchanged\nmore\n")
    (m.mnt / "src" / "new.py").write_text("x = 1\n")
    os.unlink(m.mnt / "docs" / "guide.txt")
    os.chmod(m.mnt / "run.sh", 0o644)
    (m.mnt / "bin.dat").write_bytes(b"\0\1\2binary" * 100)
    (m.mnt / "nonl").write_text("no newline")
    patch = m.cli("diff", "base").stdout
    stat = m.cli("--json", "diff", "base", "--stat").stdout
    assert '"path": "src/new.py"' in stat
    # git apply of diff(base, live) on a copy of the tree at base gives the live tree
    work = tmp_path / "work"
    shutil.copytree(repo, work, symlinks=True)
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], input=patch.encode(), cwd=work, check=True)
    live = tree_digest(str(m.mnt))
    got = tree_digest(str(work))
    got.pop(".git", None)
    got = {k: v for k, v in got.items() if not k.startswith(".git/") and k != ".git"}
    # git tracks neither hard links nor directories: compare files and symlinks, without link counts
    strip = lambda t: {k: v[:4] + v[5:] if v[0] == "f" else v for k, v in t.items()  # noqa: E731
                       if v[0] != "d"}
    assert strip(got) == strip(live)
    assert m.cli("show", base, "README.md").stdout == "# demo\n\nhello\n"
    assert m.cli("show", "base", "src/new.py", check=False).returncode == 1


def test_browse_view_is_read_only(repo: Path, mount_factory) -> None:
    m = mount_factory(repo)
    cid = m.cli("checkpoint", "v1").stdout.strip()
    (m.mnt / "README.md").write_text("changed\n")
    view = m.mnt / ".overlayckpt" / "checkpoints" / cid
    assert (view / "README.md").read_text() == "# demo\n\nhello\n"
    assert os.readlink(m.mnt / ".overlayckpt" / "checkpoints" / "v1") == cid
    for attempt in (lambda: (view / "README.md").write_text("x"),
                    lambda: (view / "new").write_text("x"),
                    lambda: os.unlink(view / "README.md"),
                    lambda: os.mkdir(view / "d"),
                    lambda: os.chmod(view / "README.md", 0o600)):
        with pytest.raises(OSError) as e:
            attempt()
        assert e.value.errno == errno.EROFS


def test_selective_restore_and_undo(repo: Path, mount_factory) -> None:
    m = mount_factory(repo)
    base = m.cli("checkpoint").stdout.strip()
    (m.mnt / "README.md").write_text("one\n")
    (m.mnt / "src" / "main.py").write_text("two\n")
    os.unlink(m.mnt / "docs" / "guide.txt")
    proc = m.cli("restore", base, "--", "README.md", "docs/guide.txt")
    assert (m.mnt / "README.md").read_text() == "# demo\n\nhello\n"
    assert (m.mnt / "docs" / "guide.txt").read_text() == "line\n" * 5000
    assert (m.mnt / "src" / "main.py").read_text() == "two\n"
    m.cli("restore", "@before-last")
    assert (m.mnt / "README.md").read_text() == "one\n"
    assert not (m.mnt / "docs" / "guide.txt").exists()
    assert proc.returncode == 0


def test_open_file_sees_restored_content(repo: Path, mount_factory) -> None:
    m = mount_factory(repo)
    base = m.cli("checkpoint").stdout.strip()
    (m.mnt / "README.md").write_text("changed\n")
    with open(m.mnt / "README.md") as held:
        assert held.read() == "changed\n"
        m.cli("restore", base)
        held.seek(0)
        assert held.read() == "# demo\n\nhello\n"


def test_writes_answered_early_are_stored_before_anything_after_them(repo: Path,
                                                                   mount_factory) -> None:
    """Writes are acknowledged before the daemon stores them (write-behind): a
    checkpoint taken right after must still hold every one, in order."""
    m = mount_factory(repo)
    path = m.mnt / "big.bin"
    expected = bytearray()
    with open(path, "wb", buffering=0) as f:
        for i in range(2000):  # distinct 4 KiB blocks, then overwrites of earlier ones
            block = (b"%06d" % i) * 682 + b"\n\n\n\n"
            off = (i % 1500) * 4096
            f.seek(off)
            f.write(block)
            expected[off:off + 4096] = block
        cid = m.cli("checkpoint", "right-after").stdout.strip()
    view = m.mnt / ".overlayckpt" / "checkpoints" / cid / "big.bin"
    assert view.read_bytes() == bytes(expected)
    (m.mnt / "README.md").write_text("later\n")
    m.cli("restore", cid)
    with open(path, "rb") as f:  # read from the daemon, not from pages the kernel kept
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        assert f.read() == bytes(expected)


def test_a_file_a_restore_removed_stays_open_like_an_unlinked_one(repo: Path, mount_factory) -> None:
    """The restore takes the file's name; a process that has it open goes on writing and
    reading it, as after an unlink, and the restore back gives the state before, exactly."""
    m = mount_factory(repo)
    base = m.cli("checkpoint").stdout.strip()
    fd = os.open(m.mnt / "new.txt", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.write(fd, b"before\n")
        m.cli("restore", base)
        assert not (m.mnt / "new.txt").exists()
        assert os.pwrite(fd, b"after\n", 7) == 6
        os.fsync(fd)
        assert os.pread(fd, 100, 0) == b"before\nafter\n"
    finally:
        os.close(fd)
    m.cli("restore", "@before-last")
    assert (m.mnt / "new.txt").read_bytes() == b"before\n"
    # writes elsewhere go on, and are stored
    (m.mnt / "README.md").write_text("still written\n")
    cid = m.cli("checkpoint").stdout.strip()
    assert (m.mnt / ".overlayckpt" / "checkpoints" / cid / "README.md").read_text() == "still written\n"


def test_truncating_a_sparse_file_cuts_only_its_data_and_restores(repo: Path,
                                                                  mount_factory) -> None:
    m = mount_factory(repo)
    big = 1 << 30
    with open(m.mnt / "sparse.bin", "wb") as f:
        f.write(b"head" * 1024)
        f.seek(big - 4096)
        f.write(b"tail" * 1024)
    base = m.cli("checkpoint").stdout.strip()
    os.truncate(m.mnt / "sparse.bin", 3 * 4096 + 5)
    with open(m.mnt / "sparse.bin", "rb") as f:
        assert f.read() == b"head" * 1024 + bytes(2 * 4096 + 5)
    os.truncate(m.mnt / "sparse.bin", big)  # extended again: the old tail must be zeros
    with open(m.mnt / "sparse.bin", "rb") as f:
        f.seek(big - 4096)
        assert f.read() == bytes(4096)
    os.truncate(m.mnt / "docs" / "guide.txt", 4101)  # a repo file, cut mid-block
    m.cli("restore", base)
    with open(m.mnt / "sparse.bin", "rb") as f:
        assert f.read(4096) == b"head" * 1024
        f.seek(big - 4096)
        assert f.read() == b"tail" * 1024
    assert (m.mnt / "docs" / "guide.txt").read_text() == "line\n" * 5000


def test_bad_input_changes_nothing(repo: Path, mount_factory) -> None:
    m = mount_factory(repo)
    (m.mnt / "README.md").write_text("changed\n")
    before = m.ctl({"cmd": "log"})["checkpoints"]
    for args in (["restore", "999"], ["restore", "nosuch"], ["show", "0", "../etc/passwd"],
                 ["diff", "0", "777"], ["checkpoint", "12"]):
        proc = m.cli(*args, check=False)
        assert proc.returncode == 1, args
        assert proc.stderr.startswith("overlayckpt: ") and proc.stderr.count("\n") == 1, proc.stderr
        assert "Traceback" not in proc.stderr
    with open(m.mnt / ".overlayckpt" / "ctl", "r+b", buffering=0) as f:
        with pytest.raises(OSError) as e:
            f.write(b"{not json\n")
        assert e.value.errno == errno.EINVAL
        assert b"malformed JSON" in f.read()
    assert m.ctl({"cmd": "log"})["checkpoints"] == before
    assert (m.mnt / "README.md").read_text() == "changed\n"


def test_unmounted_session_commands_and_resume(repo: Path, mount_factory) -> None:
    m = mount_factory(repo)
    (m.mnt / "README.md").write_text("changed\n")
    ino = os.stat(m.mnt / "README.md").st_ino
    force_unmount(str(m.mnt))
    wait_daemon_gone(m.store)
    log = run_cli("--store", str(m.store), "--json", "log").stdout
    assert "README.md" in log
    assert run_cli("--store", str(m.store), "show", "0", "README.md").stdout == "# demo\n\nhello\n"
    run_cli("mount", str(repo), str(m.mnt), "--store", str(m.store))
    assert (m.mnt / "README.md").read_text() == "changed\n"
    assert os.stat(m.mnt / "README.md").st_ino == ino


def test_checkpoints_listing_follows_new_and_thinned_checkpoints(repo: Path, mount_factory) -> None:
    # the kernel keeps directory listings; this one must be dropped when it changes
    m = mount_factory(repo, "--window", "0")
    views = m.mnt / ".overlayckpt" / "checkpoints"

    def ids_logged() -> set[str]:
        log = m.ctl_ok({"cmd": "log"})["checkpoints"]
        return {str(c["id"]) for c in log} | {c["name"] for c in log if c["name"]}
    assert set(os.listdir(views)) == ids_logged()
    for i in range(4):
        (m.mnt / "docs" / "guide.txt").write_text(f"version {i}\n")
        assert set(os.listdir(views)) == ids_logged()  # no stat in between
    m.cli("checkpoint", "named")
    assert "named" in os.listdir(views)
    before = set(os.listdir(views))
    assert m.ctl_ok({"cmd": "gc", "budget": 0})["thinned"] > 0
    assert set(os.listdir(views)) == ids_logged() != before


def test_retention_thins_old_auto_checkpoints_and_keeps_the_rest_exact(repo: Path, mount_factory) -> None:
    m = mount_factory(repo, "--window", "0")
    recorded: dict[int, dict] = {}
    for i in range(12):
        (m.mnt / "docs" / "guide.txt").write_text(f"version {i}\n" * 3000)
        if i == 3:
            recorded[int(m.cli("checkpoint", "keep-me").stdout)] = tree_digest(str(m.mnt))
    log = m.ctl_ok({"cmd": "log"})["checkpoints"]
    views = m.mnt / ".overlayckpt" / "checkpoints"
    for c in log:  # every checkpoint's tree before thinning, read through its view
        recorded[c["id"]] = tree_digest(str(views / str(c["id"])))
    result = m.ctl_ok({"cmd": "gc", "budget": 0})
    assert result["thinned"] > 0 and result["removed_blocks"] > 0
    after = {c["id"]: c for c in m.ctl_ok({"cmd": "log"})["checkpoints"]}
    assert any(c["name"] == "keep-me" for c in after.values())
    assert len(after) < len(log) + 2
    for cid in after:
        if cid in recorded:
            m.cli("restore", str(cid))
            assert tree_digest(str(m.mnt)) == recorded[cid], f"checkpoint {cid} changed by thinning"


def test_a_restore_across_a_new_directory_takes_its_one_name(repo: Path, mount_factory) -> None:
    """The restore writes and invalidates the new directory's own name only: the kernel drops
    the names cached below it with it. A process whose working directory is inside still
    finds what it held, as in a directory moved away (gc sweeps it once nothing names it)."""
    m = mount_factory(repo)
    base = m.cli("checkpoint").stdout.strip()
    d = m.mnt / "made"
    (d / "sub").mkdir(parents=True)
    for i in range(200):
        (d / f"f{i}").write_text(f"file {i}\n")
    (d / "sub" / "deep").write_text("deep\n")
    after = tree_digest(str(m.mnt))
    assert (d / "f7").read_text() == "file 7\n" and (d / "sub" / "deep").exists()  # (cached)
    inside = subprocess.Popen(
        ["python3", "-c", "import os, sys; sys.stdin.readline(); "
         "print(os.path.exists('f7'), os.path.exists('sub/deep'), os.path.exists('f8'))"],
        cwd=d, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        m.cli("restore", base)
        out, _ = inside.communicate("go\n", timeout=60)
    finally:
        inside.kill()
        inside.wait()
    assert out.split() == ["True", "True", "True"]
    assert not d.exists() and "made" not in os.listdir(m.mnt)
    m.cli("restore", "@before-last")
    assert tree_digest(str(m.mnt)) == after
    assert (d / "f7").read_text() == "file 7\n"
    # once swept by gc, what a restore unnamed comes back all the same (key by key)
    m.cli("restore", base)
    assert json.loads(m.cli("--json", "gc").stdout)["swept_inodes"] == 203
    assert not d.exists()
    m.cli("restore", "@before-last")
    assert tree_digest(str(m.mnt)) == after
    assert (d / "f7").read_text() == "file 7\n" and (d / "sub" / "deep").read_text() == "deep\n"
