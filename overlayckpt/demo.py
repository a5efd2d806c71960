"""`make demo`: a scripted agent edits a demo repo inside a mount; we rewind it.

Runs on a fresh machine with nothing but the package installed: it builds a
small git repo in a temp dir, mounts it, lets a "agent" (shell commands and
Python edits, as real agents do) change it, then shows the timeline, a diff,
a restore and the conversation rewind, and unmounts, leaving the repo as the
user saw it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

CLI = [sys.executable, "-m", "overlayckpt"]


def sh(cmd: str, cwd: str) -> None:
    print(f"  $ {cmd}")
    subprocess.run(cmd, shell=True, cwd=cwd, check=True)


def ckpt(*args: str, mnt: str) -> str:
    return subprocess.run(CLI + ["--mount", mnt, *args], check=True, capture_output=True,
                          text=True).stdout


def say(conv: str, role: str, content: str, tool: str | None = None) -> None:
    line = {"role": role, "content": content}
    if tool:
        line["tool"] = tool
    with open(conv, "a") as f:
        f.write(json.dumps(line) + "\n")


def title(text: str) -> None:
    print(f"\n== {text}")


def main() -> int:
    base = tempfile.mkdtemp(prefix="overlayckpt-demo-")
    repo = os.path.join(base, "app")
    os.makedirs(os.path.join(repo, "app"))
    with open(os.path.join(repo, "app", "auth.py"), "w") as f:
        f.write(textwrap.dedent('''\
            def check(user, password):
                return password == user.password
            '''))
    with open(os.path.join(repo, "app", "user.py"), "w") as f:
        f.write("class User:\n    def __init__(self, name, password):\n"
                "        self.name = name\n        self.password = password\n")
    with open(os.path.join(repo, "README.md"), "w") as f:
        f.write("# demo app\n")
    env = dict(os.environ, GIT_AUTHOR_NAME="demo", GIT_AUTHOR_EMAIL="demo@example.com",
               GIT_COMMITTER_NAME="demo", GIT_COMMITTER_EMAIL="demo@example.com")
    subprocess.run("git init -q && git add -A && git commit -qm initial", shell=True, cwd=repo,
                   check=True, env=env)
    mnt = os.path.join(base, "mnt")
    os.makedirs(mnt)
    store = os.path.join(base, "store")
    title(f"mount {repo} at {mnt}")
    subprocess.run(CLI + ["mount", repo, mnt, "--store", store, "--window", "0.3"], check=True)
    conv = os.path.join(mnt, ".overlayckpt", "conversation.jsonl")
    try:
        title("the agent works inside the mount (edit tool, sed -i, rm, git)")
        say(conv, "user", "hash the passwords")
        print(ckpt("checkpoint", "before-agent", "-m", "clean tree", mnt=mnt), end="")
        say(conv, "assistant", "I'll hash passwords in user.py and auth.py", tool="Edit")
        sh("sed -i 's/self.password = password/self.password = hash(password)/' app/user.py", mnt)
        sh("python3 -c \"import pathlib; p=pathlib.Path('app/auth.py'); "
           "p.write_text(p.read_text().replace('password ==', 'hash(password) =='))\"", mnt)
        subprocess.run(["sleep", "0.5"], check=True)  # the agent thinks: a new checkpoint group
        say(conv, "assistant", "Cleaning up: removing README", tool="Bash")
        sh("rm README.md && echo 'TODO: docs' > NOTES.txt", mnt)
        subprocess.run(["sleep", "0.5"], check=True)
        sh("git add -A && git commit -qm 'hash passwords' && git log --oneline | head -2", mnt)
        title("overlayckpt log")
        print(ckpt("log", mnt=mnt), end="")
        title("overlayckpt diff before-agent --stat")
        print(ckpt("diff", "before-agent", "--stat", mnt=mnt), end="")
        title("overlayckpt diff before-agent -- app/auth.py")
        print(ckpt("diff", "before-agent", "--", "app/auth.py", mnt=mnt), end="")
        title("the README deletion was a mistake: restore only README.md")
        print(ckpt("restore", "before-agent", "--", "README.md", mnt=mnt), end="")
        sh("ls && cat README.md", mnt)
        title("rewind everything (code and conversation) to before the agent")
        print(ckpt("restore", "before-agent", mnt=mnt), end="")
        sh("ls && git log --oneline && cat app/auth.py", mnt)
        print(ckpt("conversation", mnt=mnt), end="")
        title("undo that restore")
        print(ckpt("restore", "@before-last", mnt=mnt), end="")
        sh("git log --oneline | head -1", mnt)
        title("browse a checkpoint read-only")
        sh("ls .overlayckpt/checkpoints/before-agent/ && cat .overlayckpt/checkpoints/before-agent/README.md",
           mnt)
    finally:
        title("unmount (the repo itself was never written)")
        subprocess.run(CLI + ["unmount", mnt], check=True)
    sh("git status --short && git log --oneline", repo)
    print(f"\nDemo files are in {base}; the session store is {store}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
