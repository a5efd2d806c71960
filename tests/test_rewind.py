"""The rewind TUI, driven headlessly through a pipe input."""
from __future__ import annotations

import threading
from pathlib import Path

from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from conftest import Mount
from overlayckpt.cli.rewind import build_app


def drive(m: Mount, keys: list[str]) -> tuple[object, object]:
    with create_pipe_input() as pipe:
        app, state = build_app(m.ctl_ok, input=pipe, output=DummyOutput())
        result: dict = {}

        def feed() -> None:
            for k in keys:
                pipe.send_text(k)
        app.pre_run_callables.append(lambda: threading.Thread(target=feed).start())
        result["value"] = app.run()
        return result["value"], state


def test_rewind_restores_the_chosen_checkpoint(repo: Path, mount_factory) -> None:
    m = mount_factory(repo)
    m.cli("checkpoint", "first")
    (m.mnt / "README.md").write_text("second\n")
    m.cli("checkpoint", "second")
    (m.mnt / "README.md").write_text("third\n")
    # the log is newest first: move down to "first", then Enter and b(oth)
    log = m.ctl_ok({"cmd": "log"})["checkpoints"]
    steps = [c["name"] for c in log].index("first")
    result, state = drive(m, ["\x1b[B"] * steps + ["\r", "b"])
    assert result is not None and result["what"] == "both"
    assert state.current["name"] == "first"
    assert (m.mnt / "README.md").read_text() == "# demo\n\nhello\n"


def test_rewind_escape_changes_nothing(mounted: Mount) -> None:
    (mounted.mnt / "README.md").write_text("changed\n")
    result, _ = drive(mounted, ["\x1b[B", "\r", "\x1b", "q"])
    assert result is None
    assert (mounted.mnt / "README.md").read_text() == "changed\n"
