"""backout on a real mount, through the CLI: a middle checkpoint's `sed -i` is undone while
a later one's stays, in a checkpoint of its own that a restore undoes; a conflict changes
nothing; a stopped session backs out offline."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import Mount, force_unmount, run_cli

TEN = "".join(f"line {i}\n" for i in range(10))


def sed(m: Mount, script: str) -> None:
    subprocess.run(["sed", "-i", script, "notes.txt"], cwd=m.mnt, check=True, timeout=60)


def test_backout_of_a_middle_checkpoint_keeps_later_edits_to_other_lines(
        repo: Path, mount_factory) -> None:
    m = mount_factory(repo)
    notes = m.mnt / "notes.txt"
    notes.write_text(TEN)
    m.cli("checkpoint", "base")
    sed(m, "s/^line 2$/middle/")
    m.cli("checkpoint", "middle")
    sed(m, "s/^line 7$/later/")
    m.cli("checkpoint", "later")
    both = TEN.replace("line 2\n", "middle\n").replace("line 7\n", "later\n")
    assert notes.read_text() == both  # (the kernel has these pages cached now)

    out = m.cli("backout", "middle").stdout
    assert notes.read_text() == TEN.replace("line 7\n", "later\n")
    newest = json.loads(m.cli("--json", "log", "--limit", "1").stdout)["checkpoints"][0]
    middle = json.loads(m.cli("--json", "show", "middle").stdout)["id"]
    assert out.startswith(f"backed out checkpoint {middle} as checkpoint {newest['id']}: M notes.txt")
    assert (newest["kind"], newest["summary"]) == ("backout", f"backed out checkpoint {middle}")
    assert newest["files"] == [{"path": "notes.txt", "change": "M"}]

    # a restore of the checkpoint before it undoes it, by id or as @before-last
    m.cli("restore", "@before-last", "--code")
    assert notes.read_text() == both
    m.cli("restore", str(newest["id"]), "--code")
    assert notes.read_text() == TEN.replace("line 7\n", "later\n")
    m.cli("restore", str(newest["id"] - 1), "--code")
    assert notes.read_text() == both

    # a later edit of the same line: a conflict with both sides, and nothing changes
    sed(m, "s/^middle$/edited again/")
    proc = m.cli("backout", "middle", check=False)
    assert proc.returncode == 1 and proc.stdout == ""
    assert "notes.txt: line 3: changed by checkpoint" in proc.stderr
    assert "<<<<<<< now\nedited again\n" in proc.stderr and "=======\nline 2\n" in proc.stderr
    assert notes.read_text() == both.replace("middle", "edited again")

    # a stopped session: the CLI opens the store itself
    force_unmount(str(m.mnt))
    out = run_cli("--store", str(m.store), "backout", "later", "--", "notes.txt").stdout
    new_id = out.split(" as checkpoint ")[1].split(":")[0]
    shown = run_cli("--store", str(m.store), "show", new_id, "notes.txt").stdout
    assert shown == TEN.replace("line 2\n", "edited again\n")
