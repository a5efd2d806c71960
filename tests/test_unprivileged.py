"""The CLI as a normal user: install, mount, edit, checkpoint, restore, `run --private`,
unmount, and the one-line reasons of the mounts that fail.

A user made for the session (useradd, removed after) runs the project's own
interpreter (no install) through setpriv. The machine is made usable by users
the way Debian's is, for the session only, then put back: /dev/fuse read-write
for all (Debian's default mode) and search permission on the directories
leading to the interpreter (pyenv's lives under /root): see helpers_users.py.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import force_unmount, is_mounted, make_repo, stop_daemon
from helpers_users import FUSE, ROOT, User

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="making a test user needs root")


@pytest.fixture
def work(user: User) -> Iterator[Path]:
    """A directory of the user's with a repo in it; whatever is mounted below is unmounted."""
    d = Path(tempfile.mkdtemp(prefix=f"{user.name}-", dir=user.home))
    make_repo(d / "repo")
    (d / "mnt").mkdir()
    user.chown(d)
    yield d
    with open("/proc/self/mounts") as f:
        mounted = [line.split()[1] for line in f if line.split()[1].startswith(str(d))]
    for path in mounted:
        force_unmount(path)
    problems = [stop_daemon(user.home / STORES / s) for s in stores(user)]
    shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(user.home / STORES, ignore_errors=True)  # each test starts with none
    assert not any(problems), problems


STORES = Path(".local", "share", "overlayckpt")  # under the user's home


def stores(user: User) -> list[str]:
    base = user.home / STORES
    return sorted(os.listdir(base)) if base.is_dir() else []


def owners(root: Path) -> set[int]:
    return {os.lstat(p).st_uid for p in [root, *root.rglob("*")]}


def test_a_session_as_a_normal_user(user: User, work: Path) -> None:
    repo, mnt = work / "repo", work / "mnt"
    user.cli("mount", str(repo), str(mnt))
    try:
        assert user.run("sh", "-c", "echo changed > README.md && echo new > new.txt",
                        cwd=mnt).returncode == 0
        cp = user.cli("--mount", str(mnt), "--json", "checkpoint", "edited").stdout
        assert '"id"' in cp
        user.run("rm", "-rf", "src", cwd=mnt)
        log = user.cli("--mount", str(mnt), "log").stdout
        assert "[edited]" in log
        user.cli("--mount", str(mnt), "restore", "edited")
        assert user.run("test", "-f", "src/pkg/util.py", cwd=mnt).returncode == 0
        assert user.read(mnt / "README.md") == "changed\n"
        user.cli("unmount", str(mnt), "--apply")
    finally:
        force_unmount(str(mnt))
    assert not is_mounted(str(mnt))
    assert (repo / "new.txt").read_text() == "new\n"
    assert owners(repo) == {user.uid}  # what apply wrote is the user's


def test_run_private_as_a_normal_user(user: User, work: Path) -> None:
    repo = work / "repo"
    # inside: the overlay, the user's own ids, no way to take the overlay off; outside
    # (pid 1's mount namespace) nothing is mounted on the repo
    probe = ("test -d .overlayckpt && id -u > who && mkdir made && echo x > made/f && "
             f"! grep -q ' {repo} ' /proc/1/mountinfo && "
             "! umount -l . 2>/dev/null && ! fusermount3 -uz . 2>/dev/null")
    proc = user.cli("run", "--private", "--apply", "--repo", str(repo), "--", "sh", "-c", probe)
    assert proc.returncode == 0, proc.stderr
    assert not is_mounted(str(repo))
    assert (repo / "who").read_text().strip() == str(user.uid)
    assert (repo / "made" / "f").read_text() == "x\n"
    assert owners(repo) == {user.uid}
    # not applied by default: the repo keeps what it had
    user.cli("run", "--private", "--repo", str(repo), "--", "rm", "-rf", "made")
    assert (repo / "made" / "f").exists()


def test_run_private_where_user_namespaces_are_refused(user: User, work: Path) -> None:
    # the user's own user namespace, in which it forbids further ones (the kernel's
    # refusal, as with user.max_user_namespaces=0), then runs the CLI there without capabilities
    limit = ("unshare", "--user", "--map-current-user", "--keep-caps", "sh", "-c",
             'echo 0 > /proc/sys/user/max_user_namespaces && '
             'exec setpriv --inh-caps=-all --ambient-caps=-all -- "$@"', "-")
    proc = user.cli("run", "--private", "--repo", str(work / "repo"), "--", "true", check=False,
                    wrap=limit)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "overlayckpt: --private needs a user namespace, which this machine refuses (unshare failed: "
        "No space left on device): sudo sysctl user.max_user_namespaces=15000")
    assert not is_mounted(str(work / "repo"))


def one_line_failure(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_mount_without_access_to_dev_fuse(user: User, work: Path) -> None:
    os.chmod(FUSE, 0o600)
    try:
        err = one_line_failure(user.cli("mount", str(work / "repo"), str(work / "mnt"), check=False))
    finally:
        os.chmod(FUSE, 0o666)
    assert err == (f"overlayckpt: cannot mount on {work / 'mnt'}: fuse: failed to open /dev/fuse: "
                   "Permission denied; /dev/fuse is not usable by you: 'sudo chmod 0666 /dev/fuse' "
                   "(Debian's default), or mount as root")
    assert stores(user) == []  # nothing for the next mount to resume
    # once it is usable the same mount works
    user.cli("mount", str(work / "repo"), str(work / "mnt"))
    user.cli("unmount", str(work / "mnt"))


def test_allow_other_without_user_allow_other(user: User, work: Path) -> None:
    with open("/etc/fuse.conf") as f:
        if any(line.strip() == "user_allow_other" for line in f):
            pytest.skip("/etc/fuse.conf has user_allow_other: allow_other is allowed here")
    err = one_line_failure(user.cli("mount", str(work / "repo"), str(work / "mnt"), "--allow-other",
                                    check=False))
    assert "only allowed if 'user_allow_other' is set in /etc/fuse.conf" in err
    assert err.endswith("add the line 'user_allow_other' to /etc/fuse.conf, or mount without "
                        "--allow-other")
    assert stores(user) == [] and not is_mounted(str(work / "mnt"))


def test_mountpoint_of_another_user(user: User, work: Path) -> None:
    theirs = work / "theirs"
    theirs.mkdir()  # root's
    err = one_line_failure(user.cli("mount", str(work / "repo"), str(theirs), check=False))
    assert err == (f"overlayckpt: cannot mount on {theirs}: fusermount3: user has no write access "
                   f"to mountpoint {theirs}; mount on a directory you own")
    assert stores(user) == []


def test_mount_without_fusermount3(user: User, work: Path) -> None:
    # the user's own mount namespace with fusermount3's directory hidden, the CLI run there
    # without capabilities (so libfuse must fall back to fusermount3)
    bindir = os.path.dirname(os.path.realpath(shutil.which("fusermount3") or "/usr/bin/fusermount3"))
    if os.path.realpath(sys.executable).startswith(bindir + "/"):
        pytest.skip(f"the interpreter lives in {bindir}, beside fusermount3")
    setpriv = work / "setpriv"
    shutil.copy(shutil.which("setpriv") or "/usr/bin/setpriv", setpriv)
    hide = ("unshare", "--user", "--map-current-user", "--keep-caps", "--mount", "sh", "-c",
            f'mount -t tmpfs none {bindir} && exec {setpriv} --inh-caps=-all --ambient-caps=-all -- "$@"',
            "-")
    err = one_line_failure(user.cli("mount", str(work / "repo"), str(work / "mnt"), check=False, wrap=hide))
    assert err == (f"overlayckpt: cannot mount on {work / 'mnt'}: fuse: failed to exec fusermount3: "
                   "No such file or directory; install fusermount3 ('sudo apt-get install fuse3'), "
                   "or mount as root")
    assert stores(user) == []


def test_missing_and_busy_mountpoints(user: User, work: Path) -> None:
    repo, mnt = work / "repo", work / "mnt"
    err = one_line_failure(user.cli("mount", str(repo), str(work / "nowhere"), check=False))
    assert err == f"overlayckpt: mountpoint {work / 'nowhere'} is not a directory: create it first"
    user.cli("mount", str(repo), str(mnt))
    try:
        err = one_line_failure(user.cli("mount", str(repo), str(mnt), check=False))
        assert err == f"overlayckpt: {mnt} is already an overlayckpt mount: unmount it first"
        # a command holding the mount keeps it from going, and is named as the reason
        holder = subprocess.Popen(user.argv("sleep", "300", cwd=mnt), cwd="/")
        try:
            err = one_line_failure(user.cli("unmount", str(mnt), check=False))
            assert err.startswith(f"overlayckpt: cannot unmount {mnt}: ") and "fuser -m" in err
        finally:
            holder.kill()
            holder.wait()
        user.cli("unmount", str(mnt))
    finally:
        force_unmount(str(mnt))


def wheel_has_library(wheels: Path) -> bool:
    import zipfile
    (wheel,) = wheels.glob("overlayckpt-*.whl")
    return "overlayckpt/fuse/libfastpath.so" in zipfile.ZipFile(wheel).namelist()


def test_a_user_builds_from_a_checkout_it_cannot_write_and_from_an_sdist(user: User, work: Path) -> None:
    # what pip, pipx and uv do with a checkout or an sdist (here offline: the build
    # requirements are in the project's venv already)
    assert user.run("test", "-w", str(ROOT)).returncode != 0, "the checkout must be read-only to the user"
    pip_wheel = (sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w")
    proc = user.run(*pip_wheel, str(work / "from-checkout"), str(ROOT))
    assert proc.returncode == 0, proc.stderr
    assert wheel_has_library(work / "from-checkout")
    # the sdist, made from a copy of the sources, carries what the build needs
    src = work / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".*", "bench", "tests", "docs", "build", "*.so", "*.egg-info", "__pycache__"))
    user.chown(src)
    make_sdist = f"import setuptools.build_meta as b; print(b.build_sdist({str(work / 'sdist')!r}))"
    proc = user.run(sys.executable, "-c", make_sdist, cwd=src)
    assert proc.returncode == 0, proc.stderr
    sdist = work / "sdist" / proc.stdout.split()[-1]
    proc = user.run(*pip_wheel, str(work / "from-sdist"), str(sdist))
    assert proc.returncode == 0, proc.stderr
    assert wheel_has_library(work / "from-sdist")
