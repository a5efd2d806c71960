"""Exceptions the core raises; the FUSE adapter and the CLI translate them."""
from __future__ import annotations

import errno
import os


class FsError(Exception):
    """A filesystem operation failed with a POSIX errno."""

    def __init__(self, err: int, msg: str = "") -> None:
        super().__init__(msg or os.strerror(err))
        self.errno = err


class UserError(Exception):
    """A user mistake: one line of explanation, exit status 1, nothing changed."""


class Stopped(UserError):
    """The daemon stopped (a signal, an unmount) while a command ran: it was cut short."""

    def __init__(self) -> None:
        super().__init__("the daemon stopped while this command ran: run it again after mounting")


class StoreLocked(UserError):
    pass


class StoreDamaged(UserError):
    """The store failed verification: refused, never served."""


class ReaderFailed(Exception):
    """A reader process (service/reader.py) died, or failed with what is not a user's mistake."""


def enoent(msg: str = "") -> FsError:
    return FsError(errno.ENOENT, msg)


class PartlyDone(UserError):
    """A command that failed after it changed something (an apply that hit ENOSPC): its one
    line, and `details` saying what it changed, for --json and the daemon's reply."""

    def __init__(self, msg: str, details: dict[str, object]) -> None:
        super().__init__(msg)
        self.details = details
