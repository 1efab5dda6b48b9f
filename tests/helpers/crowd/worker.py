"""A crowd `Group` in a child process, driven by JSON lines on its stdin (`Worker` is the parent's side)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers.crowd.group import Group

ROOT = Path(__file__).resolve().parents[3]
"""The repository root: `python -m tests.helpers.crowd.worker` runs from there."""


class Worker:
    """A `Group` in a child process, driven by JSON lines: {"id", "cmd", "args"} -> {"id", "ok"|"error"}."""

    def __init__(self, run_id: str, log_path: Path) -> None:
        self.run_id, self.log_path = run_id, log_path
        self.proc: asyncio.subprocess.Process | None = None
        self._replies: dict[int, asyncio.Future] = {}
        self._next_id = 0
        self._reader: asyncio.Task | None = None
        self._log: Any = None

    async def spawn(self) -> None:
        self._log = open(self.log_path, "w")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.helpers.crowd.worker", "--worker", self.run_id, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, start_new_session=True, limit=1 << 24, cwd=ROOT,
            env={**os.environ, "GOGC": "50"})
        self._reader = asyncio.ensure_future(self._read_replies())

    async def _read_replies(self) -> None:
        while line := await self.proc.stdout.readline():
            reply = json.loads(line)
            future = self._replies.pop(reply["id"], None)
            if future is not None and not future.done():
                if "error" in reply:
                    future.set_exception(RuntimeError(f"crowd worker: {reply['error']}"))
                else:
                    future.set_result(reply["ok"])
        for future in self._replies.values():
            if not future.done():
                future.set_exception(RuntimeError(f"crowd worker exited; see {self.log_path}"))

    async def call(self, cmd: str, timeout_s: float = 300.0, **args: Any) -> Any:
        self._next_id += 1
        future = self._replies[self._next_id] = asyncio.get_running_loop().create_future()
        self.proc.stdin.write(json.dumps({"id": self._next_id, "cmd": cmd, "args": args}).encode() + b"\n")
        await self.proc.stdin.drain()
        return await asyncio.wait_for(future, timeout_s)

    async def kill(self) -> None:
        """Ask it to close (its daemons shut down), then SIGKILL its whole process group whatever happened."""
        if self.proc is not None:
            with contextlib.suppress(Exception):
                await self.call("close", timeout_s=15)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.proc.wait(), 10)
        if self._reader is not None:
            self._reader.cancel()
        if self._log is not None:
            self._log.close()


async def main(run_id: str) -> None:
    """Serve a Group's methods to the parent; close everything on "close" or when stdin ends."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything printed by libraries goes to the log, never into the protocol
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    group, tasks = Group(run_id), set()

    async def serve(message: dict) -> None:
        try:
            reply = {"id": message["id"], "ok": await getattr(group, message["cmd"])(**message["args"])}
        except Exception as e:
            reply = {"id": message["id"], "error": repr(e)}
        out.write(json.dumps(reply) + "\n")
        out.flush()

    try:
        while line := await stdin.readline():
            message = json.loads(line)
            if message["cmd"] == "close":
                await serve(message)
                return
            task = asyncio.ensure_future(serve(message))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        await group.close()


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    asyncio.run(main(sys.argv[2]))
