"""Run `smoe chat` (the README's first command, after its install) in a pseudo-terminal, as
a user would: wait for the greeting, ask one question, wait for a reply and the next
prompt, then /quit. Exit 1 with what was seen if any step does not come."""

import os
import pty
import re
import select
import shlex
import subprocess
import sys
import time

ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|\r")
QUESTION = "Who was Moses?"


def read_until(fd: int, pattern: str, timeout: float, seen: str = "") -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.5)[0]:
            try:
                seen += os.read(fd, 65536).decode("utf-8", "replace")
            except OSError:
                break
            if re.search(pattern, ESCAPES.sub("", seen), re.S):
                return ESCAPES.sub("", seen)
    sys.exit(f"smoe chat: no {pattern!r} within {timeout:.0f}s; the terminal showed:\n{seen}")


def main() -> None:
    argv = shlex.split(sys.argv[1]) + ["--max-tokens", "32"]
    primary, secondary = pty.openpty()
    env = {**os.environ, "TERM": "dumb", "COLUMNS": "200"}
    proc = subprocess.Popen(argv, stdin=secondary, stdout=secondary, stderr=secondary, env=env)
    os.close(secondary)
    try:
        started = time.monotonic()
        read_until(primary, r"Ctrl-D to quit", 300)
        ready = time.monotonic()
        os.write(primary, QUESTION.encode() + b"\r")
        seen = read_until(primary, re.escape(QUESTION) + r"\n.*\w.*\n> ", 120)
        replied = time.monotonic()
        os.write(primary, b"/quit\r")
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
        os.close(primary)
    reply = seen.rsplit(QUESTION, 1)[1].rsplit("\n> ", 1)[0].strip()
    print(
        f"smoe chat: ready in {ready - started:.1f}s, replied in {replied - ready:.1f}s: {reply!r}"
    )
    if code != 0:
        sys.exit(f"smoe chat exited {code} after /quit")


if __name__ == "__main__":
    main()
