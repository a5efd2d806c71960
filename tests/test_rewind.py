"""The rewind TUI, driven headlessly through a pipe input."""
from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import termios
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pyte
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from conftest import CLI, Mount
from overlayckpt.cli.rewind import Rewind, build_app
from overlayckpt.messages import R, Request


def drive(m: Mount, keys: list[str]) -> tuple[dict[str, Any] | None, Rewind]:
    with create_pipe_input() as pipe:
        def call(cmd: Request[R]) -> R:
            return cast(R, m.ctl_ok(cmd.to_json()))  # (the daemon's JSON reply to cmd is its R)
        app, state = build_app(call, input=pipe, output=DummyOutput())
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


class Terminal:
    """`overlayckpt rewind` in a pseudo-terminal of a given size, its screen kept by a
    terminal emulator (pyte) from what it draws, read in a thread."""

    def __init__(self, m: Mount, rows: int, columns: int) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.master = master
        self.screen = pyte.Screen(columns, rows)
        self.stream = pyte.ByteStream(self.screen)
        self.printed = b""  # everything, for what stays after the app leaves the screen
        self.proc = subprocess.Popen(CLI + ["--mount", str(m.mnt), "rewind"], stdin=slave,
                                     stdout=slave, stderr=slave, env={**os.environ, "TERM": "xterm"},
                                     close_fds=True)
        os.close(slave)
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # the program ended: its side of the terminal is closed
                chunk = b""
            with self.changed:
                self.stream.feed(chunk)
                self.printed += chunk
                self.changed.notify_all()
            if not chunk:
                return

    def rows(self) -> list[str]:
        with self.changed:
            return list(self.screen.display)

    def wait_for(self, what: Callable[[list[str]], bool], timeout: float = 60) -> list[str]:
        """The screen once what(its rows) holds."""
        with self.changed:
            ok = self.changed.wait_for(lambda: what(self.screen.display), timeout)
            assert ok, "the screen never showed it:\n" + "\n".join(self.screen.display)
            return list(self.screen.display)

    def send(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)
        os.close(self.master)


def showing(text: str) -> Callable[[list[str]], bool]:
    return lambda rows: any(text in row for row in rows)


def test_rewind_in_a_small_terminal_scrolls_to_the_selection_and_restores_it(mounted: Mount) -> None:
    with open(mounted.mnt / ".overlayckpt" / "conversation.jsonl", "a") as f:
        f.write(json.dumps({"role": "assistant", "tool": "Edit", "summary": "Edit README.md",
                            "content": json.dumps({"file_path": "README.md", "old_string": "a"})}) + "\n")
    for i in range(40):
        mounted.cli("checkpoint", f"step{i:02d}")
    log = mounted.ctl_ok({"cmd": "log"})["checkpoints"]
    target = log[25]  # far below the first screen of 12 rows
    term = Terminal(mounted, rows=12, columns=100)
    try:
        first = term.wait_for(showing("Enter: restore"))
        assert not showing(f"[{target['name']}]")(first)
        # the list takes 40 columns, the preview the other 59, the JSON line reads as text
        assert all(row[40] == "|" for row in first[:-1])
        term.wait_for(showing("|assistant [Edit]: README.md"))
        term.send("\x1b[B" * 25)
        term.wait_for(showing(f"[{target['name']}]"))
        with term.changed:  # the row drawn in reverse video is the target's
            marked = [y for y in range(11) if term.screen.buffer[y][0].reverse]
            assert [term.screen.display[y].split()[:2] for y in marked] == \
                [[str(target["id"]), f"[{target['name']}]"]]
        term.send("\r")
        term.wait_for(showing(f"Restore checkpoint {target['id']}:"))
        term.send("c")
        assert term.proc.wait(timeout=60) == 0
        with term.changed:
            term.changed.wait_for(lambda: b"restored checkpoint" in term.printed, 60)
        assert f"restored checkpoint {target['id']} (code)".encode() in term.printed
    finally:
        term.close()
    newest = mounted.ctl_ok({"cmd": "log", "limit": 1})["checkpoints"][0]
    assert newest["kind"] == "restore" and newest["restored_from"] == target["id"]
