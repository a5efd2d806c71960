"""Issue 32 point 10: bad values anywhere get one clear line and change nothing; what the
agent chose (file names, messages, conversation lines) reaches a terminal escaped and a
patch quoted like git's; MCP answers every bad line as JSON-RPC 2.0 says.

One session, mounted once for the module, with hostile names already in it; every test
leaves its log unchanged (but the ones that add to it on purpose, at the end).
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import CLI, Mount, make_repo, run_cli, tear_down
from helpers_users import ROOT
from security.conftest import assert_one_line, surroundings

ESC_NAME = "e\x1b[2Jx\x1b]0;TITLE\x07.txt"
NL_NAME = "nl\n+++ evil"
QUOTE_NAME = 'q"uote\tand\\back'
MESSAGE = "msg \x1b[2J\x1b]0;TITLE\x07 \x9b31m end"
CONTROL = [chr(c) for c in range(0x20) if c not in (0x0A,)] + ["\x7f", "\x9b"]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    tmp = tmp_path_factory.mktemp("bad-values")
    repo = make_repo(tmp / "repo")
    m = Mount(repo, tmp / "mnt", tmp / "store")
    m.mnt.mkdir()
    try:
        run_cli("mount", str(repo), str(m.mnt), "--store", str(m.store))
        for name in (ESC_NAME, NL_NAME, QUOTE_NAME):
            (m.mnt / name).write_text("line one\nline two\n")
        assert m.ctl({"cmd": "checkpoint", "name": "named", "message": MESSAGE})["ok"]
        with open(m.mnt / ".overlayckpt" / "conversation.jsonl", "a") as f:
            f.write(json.dumps({"role": "user\x1b[31m", "tool": "Bash\x07",
                                "content": "clear \x1b[2J title \x1b]0;T\x07\nsecond line"}) + "\n")
        yield m
    finally:
        tear_down([m], fsck=True)


def log_of(m: Mount) -> list[tuple]:
    return [(c["id"], c["kind"], c["name"], c["seq"]) for c in m.ctl_ok({"cmd": "log"})["checkpoints"]]


def no_control(text: str) -> None:
    bad = sorted({repr(c) for c in text if c in CONTROL})
    assert not bad, f"raw control characters {bad} in:\n{text}"


# -- checkpoint names and refs -------------------------------------------------------------

BAD_NAMES = ["-1", ".", "..", " ", "a\nb", "²", "１", "", "n" * 65, "tab\there", "\u202eevil",
             os.fsdecode(b"\xff")]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n)[:20] for n in BAD_NAMES])
def test_a_bad_checkpoint_name_is_refused_in_one_line(hostile: Mount, name: str) -> None:
    before = log_of(hostile)
    proc = hostile.cli("checkpoint", "--", name, check=False)
    no_control(assert_one_line(proc, "bad checkpoint name"))
    assert log_of(hostile) == before


@pytest.mark.parametrize("name", ["x\x00y", "\ud800", "-1", "a\nb"])
def test_the_ctl_refuses_the_same_names_with_einval(hostile: Mount, name: str) -> None:
    before = log_of(hostile)
    errno_, reply = ctl_raw(hostile, (json.dumps({"cmd": "checkpoint", "name": name}) + "\n").encode())
    assert errno_ == errno.EINVAL and reply["ok"] is False
    assert "\n" not in reply["error"] and "Error" not in reply["error"]
    assert log_of(hostile) == before


BAD_REFS = ["", os.fsdecode(b"\xff"), "²", "１", "-1", "a" * 3000, "\x1b[2J"]


@pytest.mark.parametrize("ref", BAD_REFS, ids=[repr(r)[:20] for r in BAD_REFS])
def test_an_unknown_ref_is_one_line_for_every_command(hostile: Mount, ref: str) -> None:
    before = log_of(hostile)
    for args in (["restore", ref], ["show", ref], ["diff", ref], ["conversation", "--at", ref],
                 ["backout", ref], ["apply", "--checkpoint", ref]):
        err = assert_one_line(hostile.cli(*args, check=False), "unknown checkpoint")
        no_control(err)
        assert len(err) < 300, err  # (a 3,000-character ref is cut short in the message)
    assert log_of(hostile) == before


@pytest.mark.parametrize("args", [["drop", "²"], ["diff", "²:1", "１:0"], ["apply", "--from", "²"],
                                  ["export", "git", "--since", "²"], ["fork", "²", "/nonexistent/x"]])
def test_a_digit_that_is_not_ascii_is_a_name_everywhere(hostile: Mount, args: list[str]) -> None:
    before = log_of(hostile)
    no_control(assert_one_line(hostile.cli(*args, check=False)))
    assert log_of(hostile) == before


# -- option values ---------------------------------------------------------------------------

@pytest.mark.parametrize("option", [["--window", "-1"], ["--window", "nan"], ["--window", "1e308"],
                                    ["--window", "inf"], ["--block-size", "-1"],
                                    ["--block-size", "0"], ["--block-size", "3000"],
                                    ["--block-size", str(1 << 40)]])
def test_a_bad_mount_option_is_one_line_and_makes_nothing(tmp_path: Path, option: list[str]) -> None:
    repo = make_repo(tmp_path / "repo")
    (tmp_path / "mnt").mkdir()
    before = surroundings(tmp_path)
    proc = run_cli("mount", str(repo), str(tmp_path / "mnt"), "--store", str(tmp_path / "store"),
                   *option, check=False)
    assert_one_line(proc, option[0])
    assert surroundings(tmp_path) == before


@pytest.mark.parametrize("args", [["log", "--limit", "-1"], ["gc", "--budget", "-1"],
                                  ["log", "--limit", str(1 << 70)]])
def test_a_bad_count_is_one_line(hostile: Mount, args: list[str]) -> None:
    before = log_of(hostile)
    assert_one_line(hostile.cli(*args, check=False), args[1])
    assert log_of(hostile) == before


# -- the control file --------------------------------------------------------------------

def ctl_raw(m: Mount, line: bytes) -> tuple[int | None, dict]:
    """(errno of the write or None, the reply) of one raw line written to ctl."""
    fd = os.open(m.mnt / ".overlayckpt" / "ctl", os.O_RDWR)
    try:
        try:
            os.write(fd, line)
            failed = None
        except OSError as e:
            failed = e.errno
        return failed, json.loads(os.read(fd, 1 << 16).decode().strip().splitlines()[-1])
    finally:
        os.close(fd)


CTL_BAD = {
    "diff-paths-nul": b'{"cmd": "diff", "paths": ["a\\u0000b"]}\n',
    "restore-paths-nul": b'{"cmd": "restore", "id": 0, "what": "code", "paths": ["x\\u0000"]}\n',
    "fork-store-nul": b'{"cmd": "fork", "store": "/tmp/x\\u0000y"}\n',
    "log-file-nul": b'{"cmd": "log", "file": "a\\u0000"}\n',
    "message-nul": b'{"cmd": "checkpoint", "message": "a\\u0000b"}\n',
    "message-surrogate": b'{"cmd": "checkpoint", "message": "\\udfff"}\n',
    "paths-surrogate": b'{"cmd": "diff", "paths": ["\\ud800"]}\n',
    "id-nan": b'{"cmd": "restore", "id": NaN}\n',
    "id-infinity": b'{"cmd": "restore", "id": -Infinity}\n',
    "id-1e308": b'{"cmd": "restore", "id": 1e308}\n',
    "id-5000-digits": b'{"cmd": "restore", "id": ' + b"9" * 5000 + b"}\n",
    "budget-float": b'{"cmd": "gc", "budget": 1e308}\n',
    "id-fullwidth": '{"cmd": "restore", "id": "１"}\n'.encode(),
    "id-superscript": '{"cmd": "restore", "id": "²"}\n'.encode(),
    "id-empty": b'{"cmd": "restore", "id": ""}\n',
    "not-utf8": b'{"cmd": "restore", "id": "\xff"}\n',
}


@pytest.mark.parametrize("line", CTL_BAD.values(), ids=CTL_BAD.keys())
def test_a_bad_ctl_value_fails_the_write_with_einval_and_says_why(hostile: Mount, line: bytes) -> None:
    before = log_of(hostile)
    failed, reply = ctl_raw(hostile, line)
    assert failed == errno.EINVAL, (failed, reply)
    assert reply["ok"] is False and reply["error"] and "\n" not in reply["error"]
    assert not any(w in reply["error"] for w in ("Error", "Exception", "Traceback", "mdb_")), reply
    assert log_of(hostile) == before


def test_a_conversation_line_with_a_lone_surrogate_is_kept(hostile: Mount) -> None:
    conv = hostile.mnt / ".overlayckpt" / "conversation.jsonl"
    with open(conv, "ab") as f:  # (was EIO: the store could not encode it)
        f.write(b'{"role": "tool", "content": "cut emoji \\ud83d here"}\n')
    lines = hostile.ctl_ok({"cmd": "conversation"})["lines"]
    assert lines[-1]["content"] == "cut emoji \ufffd here"


# -- what reaches a terminal -------------------------------------------------------------------

def test_log_diff_show_and_conversation_escape_what_a_terminal_acts_on(hostile: Mount) -> None:
    for args in (["log"], ["diff", "--stat"], ["show", "named"], ["conversation"],
                 ["log", "--limit", "1"]):
        out = hostile.cli(*args).stdout
        no_control(out)
    log = hostile.cli("log").stdout
    assert '"nl\\n+++ evil"' in log and '"e\\033[2Jx\\033]0;TITLE\\a.txt"' in log
    assert "msg \\x1b[2J\\x1b]0;TITLE\\x07 \\x9b31m end" in log
    conversation = hostile.cli("conversation").stdout
    assert "user\\x1b[31m [Bash\\x07]: clear \\x1b[2J title \\x1b]0;T\\x07\nsecond line" in conversation
    # JSON stays exact
    entries = json.loads(hostile.cli("--json", "log").stdout)
    named = next(c for c in entries["checkpoints"] if c["name"] == "named")
    assert named["message"] == MESSAGE
    paths = {f["path"] for c in entries["checkpoints"] for f in c["files"]}
    assert {ESC_NAME, NL_NAME, QUOTE_NAME} <= paths


def test_diff_quotes_names_like_git_and_git_applies_it(hostile: Mount, tmp_path: Path) -> None:
    patch = hostile.cli("diff", "0", "named").stdout
    no_control(patch.replace("\n", ""))
    assert 'diff --git "a/nl\\n+++ evil" "b/nl\\n+++ evil"\n' in patch
    assert '+++ "b/nl\\n+++ evil"\n' in patch
    assert '+++ "b/q\\"uote\\tand\\\\back"\n' in patch
    copy = tmp_path / "copy"
    shutil.copytree(hostile.repo, copy, symlinks=True)
    (copy / "patch.diff").write_text(patch)
    git = ["git", "-c", "core.quotepath=true", "apply", "--whitespace=nowarn"]
    check = subprocess.run(git + ["--check", "patch.diff"], cwd=copy, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    subprocess.run(git + ["patch.diff"], cwd=copy, check=True)
    for name in (ESC_NAME, NL_NAME, QUOTE_NAME):
        assert (copy / name).read_text() == "line one\nline two\n"
    assert not (copy / "nl").exists() and not (copy / " evil").exists()


# -- MCP ---------------------------------------------------------------------------------------

def mcp_exchange(m: Mount, *lines: str | bytes) -> list[dict]:
    data = b"".join((ln if isinstance(ln, bytes) else ln.encode()) + b"\n" for ln in lines)
    proc = subprocess.run(CLI + ["mcp", "--mount", str(m.mnt)], input=data, capture_output=True,
                          timeout=120)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    return [json.loads(ln) for ln in proc.stdout.decode().splitlines()]


def call(rid: int, tool: str, arguments: object) -> str:
    return json.dumps({"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                       "params": {"name": tool, "arguments": arguments}})


def test_mcp_answers_every_bad_line_as_json_rpc_says(hostile: Mount) -> None:
    before = log_of(hostile)
    out = mcp_exchange(
        hostile,
        json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                    "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                               "clientInfo": {"name": "t", "version": "1"}}}),
        json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        "{not json", b"\xff\xfe", "[]", '{"jsonrpc": "2.0", "id": 2}', '{"id": 3, "method": "ping"}',
        json.dumps({"jsonrpc": "2.0", "id": 4, "method": "no/such"}),
        json.dumps({"jsonrpc": "2.0", "method": "no/such/notification"}),
        call(5, "no-such-tool", {}),
        call(6, "timeline", {"limit": "abc"}),
        call(7, "timeline", {"limit": True}),
        call(8, "restore", {}),
        call(9, "restore", {"checkpoint": "0", "extra": 1}),
        call(10, "timeline", []),
        call(11, "checkpoint", {"name": "\ud800"}),
        call(12, "checkpoint", {"name": "-1"}),
        call(13, "restore", {"checkpoint": "１"}),
        call(14, "restore", {"checkpoint": "²"}),
        json.dumps({"jsonrpc": "2.0", "id": 15, "method": "ping"}),
        '{"jsonrpc": "2.0", "id": 1.5, "method": "ping"}',
    )
    by_id = {r["id"]: r for r in out if r["id"] is not None}
    nulls = [r["error"]["code"] for r in out if r["id"] is None]
    assert by_id[1]["result"]["protocolVersion"] == "2025-06-18"
    assert nulls == [-32700, -32700, -32600, -32600]  # (not JSON twice, a batch, id 1.5)
    assert by_id[2]["error"]["code"] == by_id[3]["error"]["code"] == -32600
    assert by_id[4]["error"]["code"] == -32601
    for rid in (5, 6, 7, 8, 9, 10):
        assert by_id[rid]["error"]["code"] == -32602, by_id[rid]
    for rid, words in ((11, "not valid Unicode"), (12, "bad checkpoint name"),
                       (13, "unknown checkpoint"), (14, "unknown checkpoint")):
        result = by_id[rid]["result"]
        assert result["isError"] and words in result["content"][0]["text"], result
        assert "\n" not in result["content"][0]["text"]
    assert by_id[15]["result"] == {}
    assert len(out) == 19  # one answer to each of 21 lines but the 2 notifications
    assert log_of(hostile) == before


# -- a mount we may not enter ----------------------------------------------------------------

def test_a_mount_we_may_not_search_says_permission_denied(user) -> None:
    base = Path(tempfile.mkdtemp(prefix="ockt-perm-"))
    os.chmod(base, 0o755)
    m = Mount(make_repo(base / "repo"), base / "mnt", base / "store")
    m.mnt.mkdir()
    try:
        run_cli("mount", str(m.repo), str(m.mnt), "--store", str(m.store), "--allow-other")
        os.chmod(m.mnt, 0o000)
        env = {**user.env(), "PYTHONPATH": str(ROOT)}  # (this checkout's code, as the user)
        by_option = subprocess.run(
            user.argv(*CLI, "--mount", str(m.mnt), "log", cwd=base), cwd="/", env=env,
            capture_output=True, text=True, timeout=300)
        by_env = subprocess.run(user.argv(*CLI, "log", cwd=base), cwd="/",
                                env={**env, "OVERLAYCKPT_MOUNT": str(m.mnt)},
                                capture_output=True, text=True, timeout=300)
        for proc in (by_option, by_env):
            err = assert_one_line(proc, "permission denied on", str(m.mnt))
            assert "not an overlayckpt mount" not in err
    finally:
        if m.mnt.exists():
            os.chmod(m.mnt, 0o755)
        tear_down([m], fsck=False)
        shutil.rmtree(base, ignore_errors=True)
