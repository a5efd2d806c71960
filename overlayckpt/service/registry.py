"""The command registry: which JSON command runs which handler, and which are durable.

Command modules (commands.py, export_commands.py) register their handlers with
`@command`; they are imported for that in one place only, this package's
__init__.py, so that nothing else imports a command module for its side effect.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from overlayckpt.messages import Request

# (session, request) -> reply; the session is service.session.Session, the request the
# command's class in messages.py, the reply its TypedDict
Handler = Callable[[Any, Any], Awaitable[Mapping[str, object]]]
H = TypeVar("H", bound=Handler)
COMMANDS: dict[str, Handler] = {}
# which calls of a command are durable (their changes survive a power cut once they
# answer): a checkpoint's when it is named, as SPEC 3.1 keeps named checkpoints and
# everything older than a few seconds; its other calls sync soon (Session.command)
Durable = Callable[[Any], bool]
DURABLE: dict[str, Durable] = {}
# commands that start a sync point as they answer, without waiting for the disk: a power
# cut before it ends loses nothing (after a restore's, the state it replaced is live again;
# an unnamed checkpoint is lost, as an automatic one of the same moment would be)
SYNC_SOON: set[str] = set()
# commands that reach outside the session (the repo, other sessions, other files): a
# sandboxed session (run --private) refuses them to its agent (Session.command)
REACHES_OUT: set[str] = set()

# The read-only part of a command: (session, store, command) -> result, run where no
# request of the mount waits for it (Session.read_off_loop: the reader process of a
# mount, service/reader.py, or a worker thread), so only plain data goes in and out.
Reading = Callable[[Any, Any, Any], Mapping[str, object]]
R = TypeVar("R", bound=Reading)
READINGS: dict[str, Reading] = {}


def command(request: type[Request[Any]], durable: bool | Durable = False,
            sync_soon: bool = False, reaches_out: bool = False) -> Callable[[H], H]:
    """durable: every call, or which ones (the others then sync soon); reaches_out: it
    changes something outside the session (REACHES_OUT)."""
    name = request.CMD

    def register(fn: H) -> H:
        COMMANDS[name] = fn
        if reaches_out:
            REACHES_OUT.add(name)
        if durable:
            DURABLE[name] = durable if callable(durable) else lambda cmd: True
        if sync_soon:
            SYNC_SOON.add(name)
        return fn
    return register


def reading(request: type[Request[Any]]) -> Callable[[R], R]:
    def register(fn: R) -> R:
        READINGS[request.CMD] = fn
        return fn
    return register
