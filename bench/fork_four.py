"""Issue 20's "Done when", run on a copy of the bench repo: four forks of one checkpoint run
four different edit scripts at once; each restores and exports on its own; diff between
two forks is exact; `apply --from` of the winner writes exactly its tree into the repo;
a backout of a middle checkpoint keeps a later edit. Prints each step and its time;
exits 1 at the first check that fails.

    python -m bench.fork_four [REPO] [WORKDIR]    (default: bench/work/repo-100000, /tmp/fork-four)
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CLI = str(Path(sys.executable).with_name("overlayckpt"))
EDITS = [  # one shell script per fork, run at once
    "find docs -name '*.md' | sort | head -300 | xargs sed -i 's/a/A/g'",
    "mkdir generated && for k in $(seq 1 3000); do echo \"file $k\" > generated/g$k.txt; done",
    "rm -rf packages/$(ls packages | sort | head -1) packages/$(ls packages | sort | sed -n 2p)",
    "python3 -c \"import pathlib; [p.write_text(p.read_text() + '# edited\\n') "
    "for p in sorted(pathlib.Path('packages').rglob('*.py'))[:500]]\"",
]


def cli(*args: str) -> str:
    return subprocess.run([CLI, *args], check=True, capture_output=True, text=True).stdout


def tree(root: Path) -> dict[str, str]:
    """path -> digest of every file and link below root, .git and the control dir left out."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in (".git", ".overlayckpt"))
        for name in files:
            p = Path(dirpath, name)
            data = os.readlink(p).encode() if p.is_symlink() else p.read_bytes()
            out[str(p.relative_to(root))] = hashlib.blake2b(data, digest_size=16).hexdigest()
    return out


def step(what: str, t0: float) -> None:
    print(f"{time.monotonic() - t0:7.1f} s  {what}", flush=True)


def check(ok: bool, what: str) -> None:
    if not ok:
        print(f"FAILED: {what}", flush=True)
        raise SystemExit(1)


def main() -> None:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/work/repo-100000").resolve()
    work = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/fork-four")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    os.environ["XDG_DATA_HOME"] = str(work / "data")  # the sessions of this run only
    t0 = time.monotonic()
    repo, mnt = work / "repo", work / "mnt"
    shutil.copytree(src, repo, symlinks=True)
    mnt.mkdir()
    forks = [work / f"fork{i}" for i in range(1, 5)]
    cli("mount", str(repo), str(mnt))
    mounted = [mnt]
    try:
        cli("checkpoint", "base", "--mount", str(mnt))
        base = tree(mnt)
        step(f"mounted a copy of {src.name} ({len(base):,} files), checkpoint base", t0)
        for f in forks:
            f.mkdir()
            t = time.monotonic()
            cli("fork", "base", str(f), "--mount", str(mnt))
            mounted.append(f)
            step(f"fork of base at {f} in {time.monotonic() - t:.2f} s", t0)
        check(all(tree(f) == base for f in forks[:1]), "a fork shows the base tree")
        procs = [subprocess.Popen(["bash", "-c", script], cwd=f) for f, script in zip(forks, EDITS)]
        check(all(p.wait() == 0 for p in procs), "the four edit scripts ran")
        edited = []
        for f in forks:
            cli("checkpoint", "edited", "--mount", str(f))
            edited.append(tree(f))
        check(len({str(sorted(e.items())) for e in edited}) == 4 and all(e != base for e in edited),
              "four different trees")
        check(tree(mnt) == base, "the parent is untouched")
        step("four edit scripts at once, each fork checkpointed", t0)
        for i, f in enumerate(forks):
            cli("restore", "0", "--mount", str(f))  # (a fork's checkpoint 0: its fork point)
            check(tree(f) == base, f"fork {i + 1} restored to base")
            if i == 0:  # (a walk reads every file: once is enough to show they stay apart)
                check(all(tree(g) == edited[j] for j, g in enumerate(forks) if j != i),
                      "the others unchanged")
            cli("restore", "@before-last", "--mount", str(f))
            check(tree(f) == edited[i], f"fork {i + 1} back to its edits")
        step("each fork restored to base and back alone, the others unchanged", t0)
        for f in forks:
            cli("export", "git", "--mount", str(f))
        branches = subprocess.run(["git", "-C", str(repo), "branch", "--list", "overlayckpt/*"],
                                  check=True, capture_output=True, text=True).stdout.split()
        check(len(branches) >= 4, f"four export branches: {branches}")
        step(f"each fork exported to its own branch: {', '.join(b for b in branches if b != '*')}", t0)
        ids = {}
        for line in cli("sessions", str(repo)).splitlines():
            for f in forks:
                if str(f) in line:
                    ids[f] = line.split()[0].strip("*")
        check(len(ids) == 4, f"sessions lists the four forks: {ids}")
        a, b = forks[0], forks[1]
        listed = {line.split()[1] for line in cli("diff", f"{ids[a]}:", f"{ids[b]}:", "--stat",
                                                   "--repo", str(repo)).splitlines()
                  if len(line.split()) > 2 and line.split()[0] in "AMD"}
        want = {p for p in set(edited[0]) | set(edited[1]) if edited[0].get(p) != edited[1].get(p)}
        check(listed == want, f"diff between forks 1 and 2: {len(listed)} files listed, {len(want)} differ")
        step(f"diff between forks 1 and 2 exact ({len(want)} files)", t0)
        cli("unmount", str(mnt), "--no-apply")
        mounted.remove(mnt)
        cli("apply", "--from", ids[forks[1]], "--repo", str(repo))
        check(tree(repo) == edited[1], "apply --from wrote the winner's tree into the repo")
        step("apply --from fork 2 wrote exactly its tree into the repo", t0)
        note = forks[3] / "README.md"
        lines = note.read_text().splitlines(keepends=True)
        note.write_text("".join(["middle edit\n", *lines[1:]]))
        cli("checkpoint", "middle", "--mount", str(forks[3]))
        note.write_text(note.read_text() + "later edit\n")
        cli("checkpoint", "later", "--mount", str(forks[3]))
        cli("backout", "middle", "--mount", str(forks[3]))
        check(note.read_text() == "".join(lines) + "later edit\n", "backout kept the later edit")
        step("backout of a middle checkpoint kept the later edit", t0)
        print("all checks passed")
    finally:
        for m in reversed(mounted):
            subprocess.run([CLI, "unmount", str(m), "--no-apply"], capture_output=True)


if __name__ == "__main__":
    main()
