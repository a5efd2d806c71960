"""Real projects for the build and test-suite workloads (issue 19).

Two pinned sdists from PyPI, fetched once by ``make bench``'s install step
(``python -m bench.projects``) so that no benchmark needs the network:

- LuaJIT 2.1, the C project lupa's sdist ships (``third-party/luajit21``): a real
  Makefile that builds a host tool, generates headers with it, then compiles
  about 70 objects into a static library, a shared one and the interpreter.
- click 8.1.7, whose sdist carries its pytest suite (about 600 tests).

They are unpacked side by side into one git repository, ``bench/work/repo-projects``,
which every contender mounts as its lower, as a user mounts a checkout.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

from bench.gen import WORK_DIR, Repo, _git

# name -> (url, sha256, the directory of the tarball to take, where it goes in the repo)
SDISTS = {
    "lupa-2.6.tar.gz": (
        "https://files.pythonhosted.org/packages/b8/1c/191c3e6ec6502e3dbe25a53e27f69a5daeac3e56de1f73c0138224171ead/"
        "lupa-2.6.tar.gz",
        "9a770a6e89576be3447668d7ced312cd6fd41d3c13c2462c9dc2c2ab570e45d9",
        "lupa-2.6/third-party/luajit21", "luajit"),
    "click-8.1.7.tar.gz": (
        "https://files.pythonhosted.org/packages/96/d3/f04c7bfcf5c1862a2a5b845c6b2b360488cf47af55dfa79c98f6a6bf98b5/"
        "click-8.1.7.tar.gz",
        "ca9853ad459e787e2192211578cc907e7594e294c7ccc834310722b41b9ca6de",
        "click-8.1.7", "click"),
}
DOWNLOADS = WORK_DIR / "downloads"
PROJECTS_VERSION = 1
C_PROJECT = "luajit"
PY_PROJECT = "click"


class ProjectsMissing(RuntimeError):
    """The sdists were not fetched (no network at bench time)."""


def fetch(log=print) -> None:
    """Download every sdist not already here, checking its sha256."""
    DOWNLOADS.mkdir(parents=True, exist_ok=True)
    for name, (url, sha, _, _) in SDISTS.items():
        dest = DOWNLOADS / name
        if dest.exists() and hashlib.sha256(dest.read_bytes()).hexdigest() == sha:
            continue
        log(f"fetching {url}")
        with urllib.request.urlopen(url, timeout=120) as r:
            data = r.read()
        got = hashlib.sha256(data).hexdigest()
        if got != sha:
            raise RuntimeError(f"{name}: sha256 {got}, expected {sha}; not using it")
        tmp = dest.with_suffix(".part")
        tmp.write_bytes(data)
        tmp.rename(dest)


def _unpack(tarball: Path, member_dir: str, dest: Path) -> None:
    prefix = member_dir.rstrip("/") + "/"
    with tarfile.open(fileobj=io.BytesIO(tarball.read_bytes()), mode="r:gz") as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name[len(prefix):]
        tf.extractall(dest, members=[m for m in members if m.name], filter="data")


def ensure_projects_repo(log=print) -> Repo:
    """The repo of both projects, made from the fetched sdists on first use."""
    path = WORK_DIR / "repo-projects"
    manifest = WORK_DIR / "repo-projects.json"
    if manifest.exists() and path.is_dir():
        meta = json.loads(manifest.read_text())
        if meta.get("version") == PROJECTS_VERSION:
            return Repo(len(meta["files"]), path, [(p, s) for p, s in meta["files"]])
    missing = [n for n in SDISTS if not (DOWNLOADS / n).exists()]
    if missing:
        raise ProjectsMissing(f"{', '.join(missing)} not in {DOWNLOADS}: run `python -m bench.projects` "
                              "(it downloads them from PyPI) before the bench")
    tmp = WORK_DIR / "repo-projects.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for name, (_, _, member_dir, where) in SDISTS.items():
        log(f"projects: unpacking {name} into {where}/")
        _unpack(DOWNLOADS / name, member_dir, tmp / where)
    _git(tmp, "init", "-q", "-b", "main")
    _git(tmp, "add", "-A")
    _git(tmp, "commit", "-q", "-m", "LuaJIT 2.1 (from lupa 2.6) and click 8.1.7")
    _git(tmp, "status", "--porcelain")
    files = sorted((str(p.relative_to(tmp)), p.stat().st_size) for p in tmp.rglob("*")
                   if p.is_file() and ".git" not in p.relative_to(tmp).parts)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    manifest.write_text(json.dumps({"version": PROJECTS_VERSION, "files": files}))
    return Repo(len(files), path, files)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.projects``: fetch the sdists and build the projects repo."""
    try:
        fetch(log=lambda m: print(m, file=sys.stderr))
    except OSError as e:
        print(f"bench.projects: cannot download the pinned sdists ({e}); the build and test-suite "
              "workloads need them once, with network", file=sys.stderr)
        return 1
    repo = ensure_projects_repo(log=lambda m: print(m, file=sys.stderr))
    print(f"{repo.path}: {len(repo.files)} files, {repo.total_bytes / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
