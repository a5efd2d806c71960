"""export git, export bundle and import, on recorded sessions over real mounts.

The oracle for a commit is the checkpoint's own read-only view
(`.overlayckpt/checkpoints/ID/`) minus anything inside a `.git`; the oracle for
a bundle is the original session: every view and every restore must match.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from conftest import CLI, Mount, force_unmount, run_cli, tree_digest, wait_daemon_gone

GIT_ENV = dict(os.environ, GIT_AUTHOR_NAME="user", GIT_AUTHOR_EMAIL="user@example.com",
               GIT_COMMITTER_NAME="user", GIT_COMMITTER_EMAIL="user@example.com",
               GIT_OPTIONAL_LOCKS="0", GIT_CONFIG_NOSYSTEM="1")


def git(cwd: Path | str, *args: str, check: bool = True) -> str:
    proc = subprocess.run(["git", "-c", "protocol.file.allow=always", *args], cwd=cwd,
                          capture_output=True, text=True, env=GIT_ENV)
    if check and proc.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed:\n{proc.stderr}")
    return proc.stdout


@pytest.fixture
def git_repo(repo: Path, tmp_path: Path) -> Path:
    """The sample repo as a git repo: commits, a second branch, a stash, an untracked
    file, a nested repository and a submodule."""
    sub_src = tmp_path / "sub-src"
    sub_src.mkdir()
    git(sub_src, "init", "-q")
    (sub_src / "mod.c").write_text("int mod;\n")
    git(sub_src, "add", "-A")
    git(sub_src, "commit", "-qm", "sub")
    git(repo, "init", "-q", "-b", "main")
    nested = repo / "vendor" / "lib"
    nested.mkdir(parents=True)
    git(nested, "init", "-q")
    (nested / "lib.py").write_text("LIB = 1\n")
    git(nested, "add", "-A")
    git(nested, "commit", "-qm", "nested")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "init")
    git(repo, "submodule", "add", "-q", str(sub_src), "sub")
    git(repo, "commit", "-qm", "submodule")
    git(repo, "branch", "feature")
    (repo / "README.md").write_text("# stashed change\n")
    git(repo, "stash", "-q")
    (repo / "untracked.txt").write_text("not in git\n")
    return repo


def user_state(repo: Path) -> dict:
    """Everything of the user's git state that export must not touch."""
    g = repo / ".git"
    refs = [line for line in git(repo, "for-each-ref", "--format=%(refname) %(objectname)").splitlines()
            if not line.startswith("refs/heads/overlayckpt/")]
    files = {name: (g / name).read_bytes() for name in ("HEAD", "index", "config", "packed-refs")
             if (g / name).exists()}
    work = {k: v for k, v in tree_digest(str(repo)).items() if k != ".git" and not k.startswith(".git/")}
    return {"refs": refs, "files": files, "work": work, "modules": tree_digest(str(g / "modules")),
            "stash": git(repo, "stash", "list", "--format=%H"),
            "nested": git(repo / "vendor" / "lib", "rev-parse", "HEAD")}


def blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def view_tree(root: Path) -> dict[str, tuple[str, str]]:
    """What git should hold of a tree: path -> (mode, blob sha), nothing inside a .git."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d.lower() != ".git"]
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if name.lower() == ".git" or stat.S_ISDIR(st.st_mode):
                continue
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("120000", blob_sha(os.fsencode(os.readlink(p))))
            elif stat.S_ISREG(st.st_mode):
                mode = "100755" if st.st_mode & stat.S_IXUSR else "100644"
                out[rel] = (mode, blob_sha(Path(p).read_bytes()))
    return out


def commit_tree(repo: Path, commit: str) -> dict[str, tuple[str, str]]:
    raw = subprocess.run(["git", "ls-tree", "-r", "-z", commit], cwd=repo, capture_output=True,
                         check=True, env=GIT_ENV).stdout
    out = {}
    for entry in raw.split(b"\0"):
        if entry:
            meta, path = entry.split(b"\t", 1)
            mode, _, sha = meta.decode().split()
            out[os.fsdecode(path)] = (mode, sha)
    return out


def exported(repo: Path, branch: str) -> dict[int, str]:
    """Checkpoint id -> commit, for the commits of the branch that export made."""
    out: dict[int, str] = {}
    if git(repo, "rev-parse", "-q", "--verify", branch, check=False) == "":
        return out
    for rec in git(repo, "log", "-z", "--format=%H%n%B", branch).split("\0"):
        sha, _, body = rec.strip("\n").partition("\n")
        m = re.search(r"^Checkpoint-Id: (\d+)$", body, re.M)
        if not m:
            break  # the repo's own history below the exported commits
        assert int(m.group(1)) not in out, "a checkpoint was exported twice"
        out[int(m.group(1))] = sha
    return out


def checkpoint_ids(m: Mount) -> list[int]:
    return sorted(int(n) for n in os.listdir(m.mnt / ".overlayckpt" / "checkpoints") if n.isdigit())


def say(m: Mount, role: str, content: str, **extra: str) -> None:
    with open(m.mnt / ".overlayckpt" / "conversation.jsonl", "a") as f:
        f.write(json.dumps({"role": role, "content": content, **extra}) + "\n")


def step(rng: random.Random, root: Path, i: int) -> None:
    """One random agent edit, through files, the shell or git (which writes under .git)."""
    files: list[Path] = []
    dirs: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != ".git")
        dirs += [Path(dirpath, d) for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        files += [Path(dirpath, f) for f in sorted(filenames)
                  if f != ".git" and os.path.isfile(os.path.join(dirpath, f))
                  and not os.path.islink(os.path.join(dirpath, f))]
    op = rng.choice(["write", "append", "create", "delete", "rename", "chmod", "symlink",
                     "rmtree", "sed", "truncate", "shell", "nested", "agent-git"])
    if op == "write":
        f = rng.choice(files)
        with open(f, "r+b") as fh:
            fh.seek(rng.randrange(0, max(1, f.stat().st_size)))
            fh.write(f"edit {i}\n".encode() * rng.randrange(1, 500))
    elif op == "append":
        with open(rng.choice(files), "a") as fh:
            fh.write(f"appended {i}\n")
    elif op == "create":
        (rng.choice([root] + dirs) / f"new{i}.txt").write_text(f"new file {i}\n" * rng.randrange(1, 50))
    elif op == "delete":
        rng.choice(files).unlink()
    elif op == "rename":
        rng.choice(files).rename(rng.choice([root] + dirs) / f"moved{i}")
    elif op == "chmod":
        rng.choice(files).chmod(rng.choice([0o600, 0o644, 0o755]))
    elif op == "symlink":
        (rng.choice([root] + dirs) / f"link{i}").symlink_to(f"target{i}")
    elif op == "rmtree":
        d = rng.choice(dirs)
        if d.name not in ("vendor", "lib", "sub"):  # keep the nested repos' .git
            shutil.rmtree(d)
    elif op == "sed":
        subprocess.run(["sed", "-i", "s/e/E/", str(rng.choice(files))], check=True)
    elif op == "truncate":
        os.truncate(rng.choice(files), rng.randrange(0, 3000))
    elif op == "shell":
        subprocess.run(f"mkdir -p sh{i}/a && echo {i} > sh{i}/a/f && cp -r sh{i} sh{i}b && "
                       f"rm -rf sh{i}/a && echo {i} > sh{i}/a", shell=True, cwd=root, check=True)
    elif op == "nested" and (root / "vendor" / "lib").is_dir():
        (root / "vendor" / "lib" / f"lib{i}.py").write_text(f"X = {i}\n")
    elif op == "agent-git" and (root / ".git").is_dir():
        git(root, "add", "-A", check=False)
        git(root, "commit", "-qm", f"agent {i}", check=False)


def record(m: Mount, seed: int, steps: int, trees: bool = True) -> dict[int, dict]:
    """A random session with named checkpoints, a restore and conversation; returns the
    live tree at each named checkpoint (if trees)."""
    rng = random.Random(seed)
    live: dict[int, dict] = {}
    for i in range(steps):
        say(m, "user", f"step {i}\nplease")
        say(m, "assistant", f"did step {i}", tool="Bash")  # a call is logged before its changes
        step(rng, m.mnt, i)
        live[m.ctl({"cmd": "checkpoint"})["id"]] = tree_digest(str(m.mnt)) if trees else {}
        if i == steps // 2:
            assert m.ctl({"cmd": "restore", "id": min(live)})["ok"]
            cid = m.ctl({"cmd": "checkpoint", "name": "after-restore"})["id"]
            live[cid] = tree_digest(str(m.mnt)) if trees else {}
    return live


def assert_commits_match_views(m: Mount, repo: Path, branch: str, since: int = 0) -> dict[int, str]:
    commits = exported(repo, branch)
    assert sorted(commits) == checkpoint_ids(m)
    for cid, sha in commits.items():
        if cid < since:
            continue
        assert commit_tree(repo, sha) == view_tree(m.mnt / ".overlayckpt" / "checkpoints" / str(cid)), \
            f"commit of checkpoint {cid} differs from its view"
    return commits


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_export_git_every_checkpoint_untouched_user_state(git_repo: Path, mount_factory) -> None:
    repo = git_repo
    before = user_state(repo)
    head = git(repo, "rev-parse", "HEAD").strip()
    m = mount_factory(repo)
    odd = m.mnt / "odd"
    odd.mkdir()
    for name in ("sp ace.txt", 'q"uote', "new\nline", "tab\tx", "\u00e9t\u00e9"):
        (odd / name).write_text(name)
    (odd / ".Git").mkdir()  # what git would refuse: never exported
    (odd / ".Git" / "config").write_text("[core]\n")
    os.mkfifo(odd / "fifo")
    record(m, seed=7, steps=10, trees=False)
    branch = "overlayckpt/store-mnt"

    out = m.cli("export", "git").stdout
    assert out.startswith("exported ")
    commits = assert_commits_match_views(m, repo, branch)
    assert git(repo, "rev-parse", f"{commits[0]}^").strip() == head  # on top of the user's HEAD
    message = git(repo, "log", "-1", "--format=%B", commits[max(commits)])
    assert "Checkpoint-Kind: named" in message and "Overlayckpt-Session: store-mnt" in message
    step_msgs = [git(repo, "log", "-1", "--format=%B", c) for c in commits.values()]
    assert any("  user: step 3\n    please" in msg and "assistant [Bash]: did step 3" in msg
               for msg in step_msgs), "conversation lines missing from the messages"
    assert user_state(repo) == before

    tip = git(repo, "rev-parse", branch)
    again = m.cli("export", "git", "--json")
    assert json.loads(again.stdout)["exported"] == []  # idempotent
    assert git(repo, "rev-parse", branch) == tip

    (m.mnt / "later.txt").write_text("later\n")
    cid = m.ctl({"cmd": "checkpoint", "name": "later"})["id"]
    later = json.loads(m.cli("export", "git", "--json").stdout)
    assert [e["id"] for e in later["exported"]][-1] == cid
    assert git(repo, "rev-parse", f"{later['exported'][0]['commit']}^").strip() == tip.strip()
    assert_commits_match_views(m, repo, branch, since=later["exported"][0]["id"])
    assert user_state(repo) == before

    # the nested repository and the submodule keep their .git, in the repo and in the mount
    assert git(m.mnt / "vendor" / "lib", "rev-parse", "HEAD") == before["nested"]
    assert (m.mnt / "sub" / ".git").read_text().startswith("gitdir:")

    # another branch from a named checkpoint on, offline after unmount: the same trees
    commits = exported(repo, branch)
    force_unmount(str(m.mnt))
    wait_daemon_gone(m.store)
    run_cli("--store", str(m.store), "export", "git", "--branch", "review", "--since", "after-restore")
    review = exported(repo, "review")
    start = min(c for c in commits if "Checkpoint-Name: after-restore" in
                git(repo, "log", "-1", "--format=%B", commits[c]))
    assert sorted(review) == [c for c in sorted(commits) if c >= start]
    for cid, sha in review.items():
        assert git(repo, "rev-parse", f"{sha}^{{tree}}") == git(repo, "rev-parse", f"{commits[cid]}^{{tree}}")
    git(repo, "update-ref", "-d", "refs/heads/review")
    assert user_state(repo) == before


@pytest.mark.parametrize("apply", [False, True])
def test_export_git_from_an_in_place_mount(git_repo: Path, tmp_path: Path, apply: bool,
                                           torn_down) -> None:
    """In place, the repo's .git is only reachable under the mount: the daemon reaches it
    through its lower fd and must neither deadlock nor write through the mount. Git in
    the mount must then see the exported branch, and the unmount's apply must keep it."""
    repo = git_repo
    store = tmp_path / "store-inplace"
    torn_down(repo, store)  # also when the unmount that applies (after the finally) fails
    run_cli("mount", str(repo), "--store", str(store), "--apply" if apply else "--no-apply")
    exported_in_mount = False
    try:
        m = Mount(repo, repo, store)
        (repo / "README.md").write_text("# edited in place\n")
        # git in the mount looks objects up before writing them: the kernel then holds
        # negative entries for .git/objects/XX directories that do not exist yet, which
        # would hide loose objects the export wrote behind the overlay
        missing = "".join(f"{i:02x}{'0' * 38}\n" for i in range(256))
        subprocess.run(["git", "cat-file", "--batch-check"], input=missing, cwd=repo,
                       capture_output=True, text=True, check=True)
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", "agent commit in the mount")
        assert git(repo, "rev-parse", "-q", "--verify", "inplace", check=False) == ""  # a negative lookup
        m.ctl({"cmd": "checkpoint", "name": "done"})
        m.cli("export", "git", "--branch", "inplace")
        assert_commits_match_views(m, repo, "inplace")
        journal = m.ctl({"cmd": "status"})["journal"]
        m.cli("export", "git", "--branch", "inplace")
        assert m.ctl({"cmd": "status"})["journal"] == journal, "export wrote through the mount"
        git(repo, "fsck", "--no-dangling", "--no-progress")
        exported_in_mount = True
    finally:
        if not (apply and exported_in_mount):
            force_unmount(str(repo))
            wait_daemon_gone(store)
    if apply:
        run_cli("unmount", str(repo))
        wait_daemon_gone(store)
        assert git(repo, "log", "-1", "--format=%s", "main").strip() == "agent commit in the mount"
    else:
        assert git(repo, "log", "-1", "--format=%s", "main").strip() == "submodule"
    assert "Checkpoint-Name: done" in git(repo, "log", "-1", "--format=%B", "inplace")
    git(repo, "fsck", "--no-dangling", "--no-progress")
    assert run_cli("--store", str(store), "fsck").returncode == 0


def test_export_git_every_until_interrupted(git_repo: Path, mount_factory) -> None:
    m = mount_factory(git_repo)
    proc = subprocess.Popen(CLI + ["--mount", str(m.mnt), "export", "git", "--every", "0.3s"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        (m.mnt / "a.txt").write_text("a\n")
        cid = m.ctl({"cmd": "checkpoint", "name": "a"})["id"]
        deadline = time.monotonic() + 30
        while cid not in exported(git_repo, "overlayckpt/store-mnt"):
            assert time.monotonic() < deadline, "--every did not export the new checkpoint"
            time.sleep(0.1)
    finally:
        # one Ctrl-C: an export under way (the branch may move before its reply) still
        # finishes and reports, then the command exits
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    assert proc.returncode == 0, err
    assert "exported" in out


def test_bundle_import_restores_every_checkpoint(repo: Path, mount_factory, tmp_path: Path) -> None:
    m = mount_factory(repo)
    live = record(m, seed=3, steps=8)
    log = m.listed_log(all=True)  # (also the rows the default view hides or folds)
    ids = checkpoint_ids(m)
    assert ids == sorted(c["id"] for c in log)
    views = {cid: tree_digest(str(m.mnt / ".overlayckpt" / "checkpoints" / str(cid))) for cid in ids}
    bundle = tmp_path / "session.bundle"
    m.cli("export", "bundle", str(bundle))
    assert "inside the mount" in one_line_error(m.cli("export", "bundle", str(m.mnt / "x"), check=False))
    assert "not a git repository" in one_line_error(m.cli("export", "git", check=False))
    force_unmount(str(m.mnt))
    wait_daemon_gone(m.store)

    # a bundle of an older overlayckpt (no lower_files) still only goes over the same directory
    old = tmp_path / "old.bundle"
    bundle_without(bundle, old, "lower_files", "seen_files")
    copy = tmp_path / "repo-copy"
    subprocess.run(["cp", "-a", str(repo), str(copy)], check=True)
    assert "not the repo as this session recorded it" in one_line_error(
        run_cli("import", str(old), "--store", str(tmp_path / "store-x"), "--repo", str(copy), check=False))
    assert not (tmp_path / "store-x").exists()
    run_cli("import", str(old), "--store", str(tmp_path / "store-old"))

    run_cli("import", str(bundle), "--store", str(tmp_path / "store-imp"))
    twice = run_cli("import", str(bundle), "--store", str(tmp_path / "store-imp"), check=False)
    assert twice.returncode == 1 and "already holds a session" in twice.stderr
    m2 = mount_factory(repo, name="imp")
    assert m2.listed_log(all=True) == log
    for cid in ids:
        assert tree_digest(str(m2.mnt / ".overlayckpt" / "checkpoints" / str(cid))) == views[cid], \
            f"checkpoint {cid} differs after import"
    for cid, digest in live.items():
        assert m2.ctl({"cmd": "restore", "id": cid})["ok"]
        assert tree_digest(str(m2.mnt)) == digest, f"checkpoint {cid} did not restore exactly"


def bundle_without(src: Path, dst: Path, *keys: str) -> None:
    """A copy of a bundle whose header lacks keys, as an older overlayckpt wrote it."""
    import msgpack
    import zstandard
    with src.open("rb") as f:
        objs = list(msgpack.Unpacker(zstandard.ZstdDecompressor().stream_reader(f), raw=False,
                                     strict_map_key=False))
    for key in keys:
        objs[0].pop(key)
    dst.write_bytes(zstandard.ZstdCompressor().compress(b"".join(msgpack.packb(o) for o in objs)))


def record_and_export(repo: Path, m: Mount, tmp_path: Path, apply: bool
                      ) -> tuple[Path, list[dict], dict[int, dict], dict[int, dict]]:
    """A session that surely refers to repo files (README.md and its hard link, a multi-block
    file, a directory), optionally applied halfway (pins); its bundle, log, views and live trees."""
    with open(m.mnt / "README.md", "a") as f:
        f.write("more\n")
    with open(m.mnt / "docs" / "guide.txt", "r+") as f:
        f.seek(9000)
        f.write("EDIT")
    (m.mnt / "src" / "pkg" / "extra.py").write_text("X = 1\n")
    live = record(m, seed=11, steps=6)
    if apply:
        m.cli("apply")  # the repo now holds the live tree; the originals are pinned in the store
        rng = random.Random(12)
        for i in range(100, 104):  # more changes over the applied repo
            step(rng, m.mnt, i)
            live[m.ctl({"cmd": "checkpoint"})["id"]] = tree_digest(str(m.mnt))
    ids = checkpoint_ids(m)
    views = {cid: tree_digest(str(m.mnt / ".overlayckpt" / "checkpoints" / str(cid))) for cid in ids}
    log = m.listed_log()
    bundle = tmp_path / "session.bundle"
    m.cli("export", "bundle", str(bundle))
    force_unmount(str(m.mnt))
    wait_daemon_gone(m.store)
    return bundle, log, views, live


@pytest.mark.parametrize("apply", [False, True])
def test_bundle_import_into_another_checkout(repo: Path, mount_factory, tmp_path: Path,
                                             apply: bool) -> None:
    """Another checkout of the repo numbers its files differently: import maps the recorded
    inodes to the checkout's, so every view and every restore is the original's."""
    m = mount_factory(repo)
    bundle, log, views, live = record_and_export(repo, m, tmp_path, apply)
    checkout = tmp_path / "checkout"
    subprocess.run(["cp", "-a", str(repo), str(checkout)], check=True)
    assert os.lstat(checkout / "docs").st_ino != os.lstat(repo / "docs").st_ino
    store = tmp_path / "store-imp"
    repo.rename(tmp_path / "recorded")  # nothing may read the recorded directory
    try:
        run_cli("import", str(bundle), "--store", str(store), "--repo", str(checkout))
        m2 = mount_factory(checkout, name="imp")
        assert m2.listed_log() == log
        for cid, digest in views.items():
            assert tree_digest(str(m2.mnt / ".overlayckpt" / "checkpoints" / str(cid))) == digest, \
                f"checkpoint {cid} differs after import into another checkout"
        for cid, digest in live.items():
            assert m2.ctl({"cmd": "restore", "id": cid})["ok"]
            assert tree_digest(str(m2.mnt)) == digest, f"checkpoint {cid} did not restore exactly"
        final = tree_digest(str(m2.mnt))
        force_unmount(str(m2.mnt))
        wait_daemon_gone(store)
        # apply's record of the repo came along: the checkout is as it expects, no conflict
        run_cli("--store", str(store), "apply")
        assert tree_digest(str(checkout)) == final
    finally:
        (tmp_path / "recorded").rename(repo)  # for the first session's fsck at teardown


def offline(session_dir: Path, repo: Path, cmd: dict) -> dict:
    """One command against a session opened without a mount, as the CLI does offline."""
    import trio

    from overlayckpt.service.session import Session
    s = Session.open(str(session_dir), str(repo), create=True)
    try:
        return trio.run(s.command, cmd)
    finally:
        s.close()


@pytest.mark.parametrize("target", ["same", "copy"])
def test_bundle_import_never_keeps_a_number_the_target_gave_another_file(tmp_path: Path,
                                                                         target: str) -> None:
    """A pinned file the target lacks must not keep its recorded inode number: there another
    file has exactly that number (as when ext4 reuses a freed number during `cp -a`; here the
    recorded file's inode, kept alive outside the repo, is moved over a file the session never
    touched, with that file's content), and it shows its own content, not the pinned one."""
    from overlayckpt.core.apply import apply_live
    from overlayckpt.core.journal import Caller
    from overlayckpt.core.timeline import Timeline
    from overlayckpt.export.importer import import_bundle
    from overlayckpt.records import ROOT_INO
    from overlayckpt.service.session import Session
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "victim.txt").write_bytes(b"the deleted file\n")
    (repo / "kept.txt").write_bytes(b"referenced\n")
    (repo / "other.txt").write_bytes(b"unrelated\n")
    number = os.lstat(repo / "victim.txt").st_ino
    bundle = tmp_path / "session.bundle"
    store = tmp_path / "store"
    assert offline(store, repo, {"cmd": "checkpoint", "name": "before"})["name"] == "before"
    s = Session.open(str(store), str(repo))
    try:
        me, ov = Caller(os.getpid(), "test"), s.overlay
        ov.write(me, ov.live(lambda r: ov.resolve(r, "kept.txt")), 0, b"R")
        ov.remove(me, ROOT_INO, b"victim.txt", False)
        os.link(repo / "victim.txt", tmp_path / "alive")  # the inode outlives apply's unlink
        apply_live(s.ctx)  # pins victim.txt (with its number) and removes it from the repo
    finally:
        s.close()
    offline(store, repo, {"cmd": "export_bundle", "path": str(bundle)})
    checkout = repo
    if target == "copy":
        checkout = tmp_path / "checkout"
        subprocess.run(["cp", "-a", str(repo), str(checkout)], check=True)
    os.rename(tmp_path / "alive", checkout / "other.txt")  # the same content, the pinned number
    (checkout / "other.txt").write_bytes(b"unrelated\n")
    assert os.lstat(checkout / "other.txt").st_ino == number

    imported = tmp_path / "store-imp"
    import_bundle(str(bundle), str(imported), str(checkout))
    s = Session.open(str(imported), str(checkout))
    try:
        ov = s.overlay
        assert ov.live(lambda r: sorted(n for n, _, _ in ov.entries(r, ROOT_INO))) == [b"kept.txt", b"other.txt"]
        ino = ov.live(lambda r: ov.resolve(r, "other.txt"))
        assert ov.live(lambda r: ov.read_all(r, ino)) == b"unrelated\n"
        assert ov.live(lambda r: ov.read_all(r, ov.resolve(r, "kept.txt"))) == b"Referenced\n"
        tl = Timeline(s.ctx)
        pinned = s.store.read(lambda r: ov.resolve(tl.state(r, tl.get(r, "before")), "victim.txt"))
        created, _ = ov.create(Caller(os.getpid(), "test"), ROOT_INO, b"new.txt", 0o100644, 0, 0)
        assert len({number, pinned, created}) == 3  # the fresh number is the overlay's own
    finally:
        s.close()
    shown = offline(imported, checkout, {"cmd": "show", "id": "before", "path": "victim.txt"})
    assert base64.b64decode(shown["content_b64"]) == b"the deleted file\n"
    shown = offline(imported, checkout, {"cmd": "show", "id": "before", "path": "other.txt"})
    assert base64.b64decode(shown["content_b64"]) == b"unrelated\n"
    fsck = offline(imported, checkout, {"cmd": "fsck"})
    assert fsck["clean"] and not fsck["problems"], fsck
    # its fresh number is above every checkpoint's inode counter, yet it was there: no
    # restore may skip it as a file made since (the import leaves the counters unknown)
    s = Session.open(str(imported), str(checkout))
    try:
        assert {ck.next_ino for ck in s.store.read(Timeline(s.ctx).all)} == {0}
    finally:
        s.close()
    offline(imported, checkout, {"cmd": "restore", "id": "before", "what": "code"})
    assert offline(imported, checkout, {"cmd": "fsck"})["clean"]
    s = Session.open(str(imported), str(checkout))
    try:
        ov = s.overlay
        assert ov.live(lambda r: ov.read_all(r, ov.resolve(r, "victim.txt"))) == b"the deleted file\n"
        assert ov.live(lambda r: ov.read_all(r, ov.resolve(r, "kept.txt"))) == b"referenced\n"
    finally:
        s.close()
    offline(imported, checkout, {"cmd": "restore", "id": "@before-last", "what": "code"})
    # exported again, the renumbered pin is the overlay's own: it stays as it is
    offline(imported, checkout, {"cmd": "export_bundle", "path": str(tmp_path / "again.bundle")})
    import_bundle(str(tmp_path / "again.bundle"), str(tmp_path / "store-again"), str(checkout))
    for path, content in (("victim.txt", b"the deleted file\n"), ("other.txt", b"unrelated\n")):
        shown = offline(tmp_path / "store-again", checkout, {"cmd": "show", "id": "before", "path": path})
        assert base64.b64decode(shown["content_b64"]) == content


def test_bundle_import_refuses_a_checkout_with_a_changed_file(repo: Path, mount_factory,
                                                              tmp_path: Path) -> None:
    m = mount_factory(repo)
    bundle, *_ = record_and_export(repo, m, tmp_path, apply=False)
    checkout = tmp_path / "checkout"
    subprocess.run(["cp", "-a", str(repo), str(checkout)], check=True)
    guide = checkout / "docs" / "guide.txt"
    data = bytearray(guide.read_bytes())
    data[100:104] = b"user"  # same size, other content
    guide.write_bytes(bytes(data))
    store = tmp_path / "store-x"
    err = one_line_error(run_cli("import", str(bundle), "--store", str(store), "--repo", str(checkout),
                                 check=False))
    assert "docs/guide.txt has other content" in err and "--repo" in err
    assert not store.exists()
    (checkout / "docs" / "guide.txt").unlink()
    err = one_line_error(run_cli("import", str(bundle), "--store", str(store), "--repo", str(checkout),
                                 check=False))
    assert "docs/guide.txt is missing" in err
    assert not store.exists()


def test_bad_inputs_fail_with_one_line(git_repo: Path, mount_factory, tmp_path: Path) -> None:
    m = mount_factory(git_repo)
    assert "unknown checkpoint" in one_line_error(m.cli("export", "git", "--since", "999", check=False))
    assert "branch name" in one_line_error(m.cli("export", "git", "--branch", "a..b", check=False))
    git(git_repo, "branch", "mine")
    assert "not made by" in one_line_error(m.cli("export", "git", "--branch", "mine", check=False))
    assert "checked out" in one_line_error(m.cli("export", "git", "--branch", "main", check=False))
    assert "does not exist" in one_line_error(
        m.cli("export", "bundle", str(tmp_path / "no" / "such" / "dir" / "x.bundle"), check=False))

    garbage = tmp_path / "garbage.bundle"
    garbage.write_bytes(os.urandom(4096))
    target = tmp_path / "store-new"
    assert "not a valid overlayckpt bundle" in one_line_error(
        run_cli("import", str(garbage), "--store", str(target), check=False))
    assert not target.exists()

    # a truncated bundle leaves no half-filled store behind
    good = tmp_path / "good.bundle"
    m.cli("export", "bundle", str(good))
    cut = tmp_path / "cut.bundle"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    one_line_error(run_cli("import", str(cut), "--store", str(target), check=False))
    assert not target.exists()

