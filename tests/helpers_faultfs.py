"""Start, cut and stop tests/faultfs.py from tests (always unmounted, also on failure)."""
from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conftest import wait_for

FAULTFS = str(Path(__file__).with_name("faultfs.py"))
START_TIMEOUT = 20.0
CUT_TIMEOUT = 60.0  # writing the image of a big store


def is_mounted(path: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


class FaultFsProc:
    """One running faultfs: IMAGE_DIR mounted at mnt."""

    def __init__(self, image: Path, mnt: Path, seed: int, mode: str, extra: tuple[str, ...] = ()) -> None:
        self.image = image
        self.mnt = mnt
        self.seed = seed
        self.mode = mode
        self.report_path = Path(str(image) + ".faultfs.json")
        self.stderr_path = Path(str(image) + ".faultfs.log")
        for stale in (self.report_path, Path(str(image) + ".arm")):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        mnt.mkdir(exist_ok=True)
        self._errf = open(self.stderr_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, FAULTFS, str(image), str(mnt), "--seed", str(seed), "--mode", mode, *extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._errf)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None  # (Popen with stdout=PIPE)
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + START_TIMEOUT
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"faultfs did not mount within {START_TIMEOUT} s: {self.log()}")
            if sel.select(timeout=left):
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    raise AssertionError(f"faultfs exited ({self.proc.wait()}): {self.log()}")
                buf += chunk
        sel.close()
        assert buf.startswith(b"READY"), buf
        assert is_mounted(str(self.mnt)), "faultfs said READY but is not mounted"

    def log(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def report(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.report_path.read_text())
        except (OSError, ValueError):
            return None

    def cut(self) -> dict[str, Any]:
        """The power cut: freeze at once; return when the crash image is in place."""
        assert self.proc.poll() is None, f"faultfs is not running: {self.log()}"
        self.proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: (self.report() or {}).get("event") == "cut" or self.proc.poll() is not None,
                 "faultfs to write its crash image", CUT_TIMEOUT)
        rep = self.report()
        assert rep and rep["event"] == "cut", f"faultfs wrote no crash image: {self.log()}"
        return rep

    def wait_cut(self, timeout: float) -> dict[str, Any] | None:
        """The report of a cut faultfs made by itself (--cut-at-write), or None after timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rep = self.report()
            if rep and rep.get("event") == "cut":
                return rep
            if self.proc.poll() is not None:
                break
            time.sleep(0.01)
        return None

    def unmount(self) -> dict[str, Any]:
        """A clean unmount (or, after a cut, the end of the frozen file system)."""
        subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True)
        if is_mounted(str(self.mnt)):  # busy (a killed client's mapping): lazily
            subprocess.run(["fusermount3", "-uz", str(self.mnt)], capture_output=True)
        try:
            self.proc.wait(timeout=CUT_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"faultfs did not exit after unmount: {self.log()}") from None
        assert self.proc.returncode == 0, f"faultfs exited with {self.proc.returncode}: {self.log()}"
        rep = self.report()
        assert rep, f"faultfs wrote no report: {self.log()}"
        self._close()
        return rep

    def stop(self) -> None:
        """Whatever state it is in: unmount and end the process (ours)."""
        if is_mounted(str(self.mnt)):
            subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True)
        deadline = time.monotonic() + 10
        while is_mounted(str(self.mnt)) and time.monotonic() < deadline:
            subprocess.run(["fusermount3", "-uz", str(self.mnt)], capture_output=True)
            time.sleep(0.05)
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close()

    def _close(self) -> None:
        if self.proc.stdout and not self.proc.stdout.closed:
            self.proc.stdout.close()
        if not self._errf.closed:
            self._errf.close()


@contextlib.contextmanager
def faultfs(image: Path, mnt: Path, seed: int = 0, mode: str = "reorder",
            extra: tuple[str, ...] = ()) -> Iterator[FaultFsProc]:
    image.mkdir(exist_ok=True)
    fs = FaultFsProc(image, mnt, seed, mode, extra)
    try:
        yield fs
    finally:
        fs.stop()
