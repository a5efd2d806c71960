"""The filesystems under test, each behind one small interface.

A contender owns its directories under the run's work dir, mounts in
``setup()``, and must leave nothing mounted after ``teardown()`` whatever
happened (``fusermount3 -u``, then ``-uz``; ``umount``, then ``umount -l``).
Workloads only see ``root`` (where to operate) and, for the two that record
history, ``checkpoint()`` / ``restore()``.

Concurrency: the harness is single-threaded except for the watchdog, which
may call ``abort()`` from its own thread to unstick a hung FUSE daemon.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.gen import GIT_ENV, Repo

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MOUNT_TIMEOUT = 60.0


class ContenderError(RuntimeError):
    """The contender cannot run (missing tool, mount failed, daemon died)."""


# --- mount helpers ------------------------------------------------------------


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mounts_under(path: Path) -> list[tuple[str, str]]:
    """(mountpoint, fstype) of every mount at or below *path*, deepest first."""
    prefix = str(path.resolve())
    out = []
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mp = _unescape(parts[1])
            if mp == prefix or mp.startswith(prefix + "/"):
                out.append((mp, parts[2]))
    out.sort(key=lambda m: -len(m[0]))
    return out


def is_mounted(path: Path) -> bool:
    target = str(path.resolve())
    return any(mp == target for mp, _ in mounts_under(path))


def force_unmount(mountpoint: str, fstype: str) -> None:
    """Unmount, retrying while busy, lazily as a last resort."""
    fuse = fstype.startswith("fuse")
    cmd = ["fusermount3", "-u", mountpoint] if fuse else ["umount", mountpoint]
    for _ in range(5):
        if subprocess.run(cmd, stderr=subprocess.DEVNULL).returncode == 0:
            return
        if not is_mounted(Path(mountpoint)):
            return
        time.sleep(0.2)
    lazy = ["fusermount3", "-uz", mountpoint] if fuse else ["umount", "-l", mountpoint]
    subprocess.run(lazy, stderr=subprocess.DEVNULL)


def wait_mounted(mnt: Path, proc: subprocess.Popen | None, log_path: Path | None,
                 timeout: float = MOUNT_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_mounted(mnt):
            try:
                os.stat(mnt)
                return
            except OSError:
                pass
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path and log_path.exists() else ""
            raise ContenderError(f"daemon exited with {proc.returncode} before mounting: {tail}")
        time.sleep(0.05)
    raise ContenderError(f"{mnt} not mounted after {timeout:.0f} s")


def copy_tree(src: Path, dst: Path) -> None:
    """A full private copy (data and .git) for contenders that write in place.

    The copy has new inode numbers and ctimes, so git's index no longer matches
    it; refresh the index here, at native speed, rather than through a mount.
    """
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    subprocess.run(["git", "update-index", "-q", "--refresh"], cwd=dst, env=_git_env(),
                   stdout=subprocess.DEVNULL, check=False)


def tree_bytes(path: Path) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of everything under *path*."""
    apparent = disk = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in filenames + dirnames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                apparent += st.st_size
            disk += st.st_blocks * 512
    return apparent, disk


def _git_env() -> dict[str, str]:
    return dict(os.environ, **GIT_ENV)


# --- contenders -----------------------------------------------------------------


class Contender:
    """Base: a directory tree that workloads operate in."""

    name = "base"
    is_fuse = False
    supports_checkpoint = False
    applies_to_fs_workloads = True

    def __init__(self, repo: Repo, workdir: Path) -> None:
        self.repo = repo
        self.workdir = workdir / self.name
        self.root: Path = self.workdir / "mnt"
        self.notes: list[str] = []
        self.ckpts: list[str] = []  # checkpoint ids, oldest first
        self._fuse_minor: int | None = None
        self.also_abort: list[int] = []  # FUSE connections a workload mounted beside ours

    # lifecycle
    def setup(self) -> None:
        raise NotImplementedError

    def teardown(self) -> None:
        """Unmount everything this contender mounted; never raises."""
        for mp, fstype in mounts_under(self.workdir):
            try:
                force_unmount(mp, fstype)
            except Exception as e:  # teardown must go on
                log.warning("unmount %s: %s", mp, e)

    def remount(self) -> None:
        """Drop the filesystem's own caches (FUSE daemons); kernel caches are dropped separately."""

    def alive(self) -> bool:
        return True

    def abort(self) -> None:
        """Called by the watchdog: make hung requests fail (FUSE connection abort)."""
        for minor in ([self._fuse_minor] if self._fuse_minor is not None else []) + self.also_abort:
            p = Path(f"/sys/fs/fuse/connections/{minor}/abort")
            try:
                p.write_text("1")
            except OSError as e:
                log.warning("abort %s: %s", p, e)

    def _note_fuse_conn(self) -> None:
        try:
            self._fuse_minor = os.minor(os.stat(self.root).st_dev)
        except OSError:
            self._fuse_minor = None

    # history
    def checkpoint(self) -> str:
        raise ContenderError(f"{self.name} has no checkpoints")

    def restore(self, ckpt: str) -> None:
        raise ContenderError(f"{self.name} has no checkpoints")

    def restore_back(self, n_back: int) -> str:
        """Restore the checkpoint *n_back* before the newest one we made; return its id."""
        target = self.ckpts[-1 - n_back]
        self.restore(target)
        return target

    def pad_history(self, count: int, step: Callable[[int], object]) -> None:
        """Add *count* checkpoints; default: *count* times (one edit via step(), checkpoint)."""
        for i in range(count):
            step(i)
            self.ckpts.append(self.checkpoint())

    def store_bytes(self) -> tuple[int, int]:
        raise ContenderError(f"{self.name} has no store")

    def daemon_pid(self) -> int | None:
        """The process serving the mount (FUSE contenders), for its memory."""
        return None


class Native(Contender):
    """A plain copy of the repo on the host filesystem: the ceiling."""

    name = "native"

    def setup(self) -> None:
        self.workdir.mkdir(parents=True)
        copy_tree(self.repo.path, self.root)


class KernelOverlay(Contender):
    """Kernel overlayfs with the generated repo as the (read-only) lower."""

    name = "overlayfs"

    def setup(self) -> None:
        if os.geteuid() != 0:
            raise ContenderError("kernel overlayfs needs root")
        for d in ("upper", "work", "mnt"):
            (self.workdir / d).mkdir(parents=True)
        opts = f"lowerdir={self.repo.path},upperdir={self.workdir / 'upper'},workdir={self.workdir / 'work'}"
        r = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(self.root)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise ContenderError(f"mount -t overlay failed: {r.stderr.strip()}")

    def alive(self) -> bool:
        return is_mounted(self.root)


class _FuseDaemon(Contender):
    """A FUSE daemon we start in the foreground and own by pid."""

    is_fuse = True

    def __init__(self, repo: Repo, workdir: Path) -> None:
        super().__init__(repo, workdir)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "daemon.log"

    def command(self) -> list[str]:
        raise NotImplementedError

    def _start(self) -> None:
        with open(self.log_path, "ab") as logf:
            # Own session: a Ctrl-C meant for the harness must not kill the daemon
            # under a mounted filesystem; teardown stops it by unmounting.
            self.proc = subprocess.Popen(self.command(), stdout=logf, stderr=logf,
                                         stdin=subprocess.DEVNULL, cwd=PROJECT_ROOT,
                                         start_new_session=True)
        wait_mounted(self.root, self.proc, self.log_path)
        self._note_fuse_conn()

    def daemon_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _stop(self) -> None:
        super().teardown()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # our own child, by pid
                self.proc.wait(timeout=10)
            self.proc = None

    def teardown(self) -> None:
        try:
            self._stop()
        except Exception as e:
            log.warning("%s teardown: %s", self.name, e)

    def remount(self) -> None:
        self._stop()
        self._start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and is_mounted(self.root)


class FuseOverlayfs(_FuseDaemon):
    """fuse-overlayfs (C, captures nothing): the bar overlayckpt must meet."""

    name = "fuse-overlayfs"

    def command(self) -> list[str]:
        opts = f"lowerdir={self.repo.path},upperdir={self.workdir / 'upper'},workdir={self.workdir / 'work'}"
        return ["fuse-overlayfs", "-f", "-o", opts, str(self.root)]

    def setup(self) -> None:
        if shutil.which("fuse-overlayfs") is None:
            raise ContenderError("fuse-overlayfs not installed (apt-get install fuse-overlayfs)")
        for d in ("upper", "work", "mnt"):
            (self.workdir / d).mkdir(parents=True)
        self._start()


class Passthrough(_FuseDaemon):
    """bench.passthrough over a private copy: the pyfuse3 floor."""

    name = "passthrough"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "bench.passthrough", str(self.workdir / "src"), str(self.root)]

    def setup(self) -> None:
        self.workdir.mkdir(parents=True)
        self.root.mkdir()
        copy_tree(self.repo.path, self.workdir / "src")
        self._start()


class ShadowGit(Contender):
    """A native copy plus a separate git dir; a checkpoint is ``add -A`` + ``commit``.

    This is how other agent tools checkpoint. For plain file operations it is
    the native directory, so it only runs the history workloads.
    """

    name = "shadow-git"
    supports_checkpoint = True
    applies_to_fs_workloads = False

    def __init__(self, repo: Repo, workdir: Path) -> None:
        super().__init__(repo, workdir)
        self.git_dir = self.workdir / "shadow.git"

    def _git(self, *args: str, input: bytes | None = None) -> bytes:
        r = subprocess.run(
            ["git", f"--git-dir={self.git_dir}", f"--work-tree={self.root}",
             "-c", "gc.auto=0", "-c", "core.fsmonitor=false", *args],
            input=input, capture_output=True, env=_git_env(), cwd=self.root)
        if r.returncode != 0:
            raise ContenderError(f"git {args[0]} failed: {r.stderr.decode(errors='replace')[-500:]}")
        return r.stdout

    def setup(self) -> None:
        self.workdir.mkdir(parents=True)
        copy_tree(self.repo.path, self.root)
        subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(self.git_dir)], check=True, env=_git_env())
        self._git("config", "core.bare", "false")
        # Borrow the repo's objects (alternates): the initial snapshot then costs
        # hashing only, and every object a checkpoint writes lands in our git dir,
        # loose, where store growth is measured.
        (self.git_dir / "objects" / "info" / "alternates").write_text(
            str(self.repo.path / ".git" / "objects") + "\n")
        self._git("add", "-A")
        self._git("commit", "-q", "--no-verify", "-m", "initial")
        self.ckpts.append(self.checkpoint_id())

    def checkpoint(self) -> str:
        self._git("add", "-A")
        self._git("commit", "-q", "--no-verify", "--allow-empty", "-m", "checkpoint")
        return self.checkpoint_id()

    def checkpoint_id(self) -> str:
        """The new commit id, read from the loose ref (as cheap as parsing commit's output)."""
        return (self.git_dir / "refs" / "heads" / "main").read_text().strip()

    def restore(self, ckpt: str) -> None:
        # Update index and work tree to the commit, deleting files it lacks.
        self._git("read-tree", "-u", "--reset", ckpt)

    def pad_history(self, count: int, step: Callable[[int], object]) -> None:
        """Pad with empty commits via one fast-import: history length is what matters here."""
        if count <= 0:
            return
        head = self.checkpoint_id()
        lines = []
        for i in range(count):
            lines.append(f"commit refs/heads/main\nmark :{i + 1}\n"
                         f"committer bench <bench@example.invalid> 1704067200 +0000\n"
                         f"data 7\npadding\n")
            lines.append(f"from {head}\n" if i == 0 else f"from :{i}\n")
            lines.append("\n")
        marks = self.workdir / "marks"
        self._git("fast-import", "--quiet", f"--export-marks={marks}", "--force",
                  input="".join(lines).encode())
        shas = {}
        for line in marks.read_text().splitlines():
            m, sha = line.split()
            shas[int(m[1:])] = sha
        self.ckpts.extend(shas[i + 1] for i in range(count))
        self.notes.append(f"history padded with {count} empty commits (git fast-import): only the "
                          "length of history matters to git, and real ones would take hours at 100k files")

    def store_bytes(self) -> tuple[int, int]:
        return tree_bytes(self.git_dir)


def run_cli(exe: str, *args: str, timeout: float = 600) -> str:
    """Run the overlayckpt CLI; its stdout, or ContenderError with what it said."""
    try:
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise ContenderError(f"overlayckpt {args[0]} timed out after {timeout:.0f} s") from e
    if r.returncode != 0:
        raise ContenderError(f"overlayckpt {' '.join(args)} exited {r.returncode}: "
                             f"{(r.stderr or r.stdout).strip()[-800:]}")
    return r.stdout


class Overlayckpt(Contender):
    """overlayckpt: mounted and unmounted through its CLI.

    Checkpoints and restores go through the daemon's control file, the channel
    the CLI itself uses, held open as a long-running agent integration would
    (``overlayckpt.cli.client.Connection``), so the numbers are the mechanism's
    cost; ``checkpoint_cli`` / ``restore_cli`` time the CLI as a user or agent
    hook would run it (process start-up included). Without an importable
    client, everything goes through the CLI.
    """

    name = "overlayckpt"
    is_fuse = True
    supports_checkpoint = True

    def __init__(self, repo: Repo, workdir: Path) -> None:
        super().__init__(repo, workdir)
        self.store = self.workdir / "store"
        self.repo_copy = self.workdir / "repo"
        exe = Path(sys.executable).parent / "overlayckpt"
        self.exe = str(exe) if exe.exists() else (shutil.which("overlayckpt") or "")
        self._conn = None
        try:
            from overlayckpt.cli.client import Connection  # the CLI's own control-channel client
            self._send = Connection
        except Exception as e:  # any import failure means: use the CLI
            self._send = None
            self.notes.append(f"control client not importable ({type(e).__name__}); checkpoints via CLI")

    def _cli(self, *args: str, timeout: float = 600) -> str:
        return run_cli(self.exe, *args, timeout=timeout)

    def _ctl(self, cmd: dict) -> dict:
        try:
            if self._conn is None:
                self._conn = self._send(str(self.root))
            from overlayckpt.messages import parse  # (the typed request the daemon parses too)
            return self._conn.call(parse(cmd))
        except Exception as e:  # UserError and friends
            raise ContenderError(f"control {cmd['cmd']}: {type(e).__name__}: {e}") from e

    def _mount(self) -> None:
        self._cli("mount", str(self.repo_copy), str(self.root), "--store", str(self.store),
                  timeout=MOUNT_TIMEOUT * 5)
        wait_mounted(self.root, None, None, timeout=MOUNT_TIMEOUT)
        self._note_fuse_conn()

    def setup(self) -> None:
        if not self.exe:
            raise ContenderError("overlayckpt CLI not found (make install)")
        self.workdir.mkdir(parents=True)
        self.root.mkdir()
        self.store.mkdir()
        # A private copy, so a bug that writes through to the repo cannot spoil other contenders.
        copy_tree(self.repo.path, self.repo_copy)
        self._mount()

    def teardown(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if is_mounted(self.root):
            try:
                self._cli("unmount", str(self.root), "--no-apply", timeout=60)
            except Exception as e:  # fall back to fusermount3
                self.notes.append(f"CLI unmount failed: {e}")
        super().teardown()

    def remount(self) -> None:
        self.teardown()
        self._mount()

    def alive(self) -> bool:
        return is_mounted(self.root)

    def checkpoint(self) -> str:
        if self._send is None:
            return self.checkpoint_cli()
        return str(self._ctl({"cmd": "checkpoint", "name": None, "message": None})["id"])

    def checkpoint_cli(self) -> str:
        out = self._cli("checkpoint", "--mount", str(self.root), "--json")
        try:
            return str(json.loads(out)["id"])
        except (ValueError, KeyError, TypeError) as e:
            raise ContenderError(f"checkpoint --json printed {out[:200]!r}") from e

    def restore(self, ckpt: str) -> None:
        if self._send is None:
            return self.restore_cli(ckpt)
        reply = self._ctl({"cmd": "restore", "id": int(ckpt)})
        self.last_restore = reply  # (its took_ms: bench's restore_delta reports the phases)
        if reply.get("warnings"):
            self.notes.append(f"restore {ckpt} warned: {reply['warnings'][:3]}")

    def restore_cli(self, ckpt: str) -> None:
        self._cli("restore", ckpt, "--mount", str(self.root))

    def daemon_pid(self) -> int | None:
        try:
            return json.loads((self.store / "session.json").read_text()).get("pid")
        except (OSError, ValueError):
            return None

    def store_bytes(self) -> tuple[int, int]:
        # the write-behind log is a fixed-size ring (32 MiB once written round): not growth
        apparent, disk = tree_bytes(self.store)
        try:
            st = os.stat(self.store / "behind.log")
        except FileNotFoundError:
            return apparent, disk
        return apparent - st.st_size, disk - st.st_blocks * 512


class OverlayckptBaseline(Overlayckpt):
    """Another build of overlayckpt, side by side with this one (before/after a change):
    the `overlayckpt` executable named by $OVERLAYCKPT_BASELINE, e.g. a checkout's .venv."""

    name = "overlayckpt-baseline"

    def __init__(self, repo: Repo, workdir: Path) -> None:
        super().__init__(repo, workdir)
        self.exe = os.environ.get("OVERLAYCKPT_BASELINE", "")
        self._send = None  # its control client may differ from ours: the CLI only


ALL: dict[str, type[Contender]] = {
    c.name: c for c in (Native, KernelOverlay, FuseOverlayfs, Passthrough, ShadowGit, Overlayckpt)
}
EXTRA: dict[str, type[Contender]] = {OverlayckptBaseline.name: OverlayckptBaseline}
