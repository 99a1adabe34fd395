"""Work on untrusted input in a worker process with a deadline and a memory cap.

A task reference from the wire names a generator and its config; some configs make a generator
loop for minutes or allocate gigabytes (reasoning-gym's basic_arithmetic with 24-digit division
never finishes). Such work cannot be interrupted inside the node's own process, so it runs in one
worker process: it starts with an address-space limit, and the caller kills it when a call
outlives its deadline and starts a fresh one at once, so that the next call finds it warm.

The worker is a plain `python -m rewards.sandbox` speaking msgpack over its stdin and stdout, not a
`multiprocessing` child: those re-import the parent's main module (the CLI, hence torch), which
costs seconds per start.
"""

from __future__ import annotations

import importlib
import logging
import os
import resource
import select
import subprocess
import sys
import time
from typing import Any

import msgpack

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0


class SandboxError(Exception):
    """A call that did not return a value; `reason` is counted by the caller."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _serve(fn_path: str, memory_bytes: int, warm: list[str]) -> None:
    """The worker: imports first (so that calls do not pay for them), then one call per message."""
    if memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    channel = sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not corrupt the channel
    for module in warm:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    module, _, name = fn_path.partition(":")
    fn = getattr(importlib.import_module(module), name)

    def reply(*msg: Any) -> None:
        channel.write(msgpack.packb(msg, use_bin_type=True))
        channel.flush()

    reply("ready")
    for args in msgpack.Unpacker(sys.stdin.buffer.raw, raw=False, strict_map_key=False):  # raw: returns what has arrived
        try:
            reply("ok", fn(*args))
        except MemoryError:
            reply("error", "regen_memory", "the worker's memory cap was reached")
        except Exception as e:  # noqa: BLE001 - untrusted input: any failure is an answer, not a crash
            reply("error", getattr(e, "reason", "regen_failed"), f"{type(e).__name__}: {e}"[:500])


class Sandbox:
    """Calls `fn_path` ("module:function", msgpack-able arguments and result) in a worker process,
    one call at a time. Owned by one thread."""

    def __init__(self, fn_path: str, memory_mb: int, warm: tuple[str, ...] = ()):
        self.fn_path, self.memory_mb, self.warm = fn_path, memory_mb, warm
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._unpacker = msgpack.Unpacker(raw=False)
        self._ready = False

    def start(self) -> None:
        """Start the worker in the background (it warms up on its own)."""
        if self._proc is not None:
            return
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, self.fn_path, str(self.memory_mb * 2**20), *self.warm],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        os.set_blocking(self._proc.stdout.fileno(), False)
        self._unpacker, self._ready = msgpack.Unpacker(raw=False), False

    def ready(self, wait: float) -> bool:
        """Whether the worker has started and warmed up, waiting up to `wait` seconds for it. A start
        is not counted against any call's deadline: a call is only made to a ready worker."""
        self.start()
        if not self._ready:
            try:
                self._ready = self._receive(time.monotonic() + max(0.0, wait)) == ["ready"]
            except SandboxError as e:
                if e.reason == "regen_crashed":
                    log.warning("the sandbox worker died while starting (is its memory cap too small?)")
        return self._ready

    def call(self, args: tuple, timeout: float) -> Any:
        """fn(*args) in the worker, or `SandboxError` once `timeout` seconds have passed (the worker is
        then killed and restarted) or the worker died. Callers with a budget wait for `ready` first."""
        if not self.ready(wait=START_TIMEOUT_S):
            raise SandboxError("regen_crashed", f"the worker did not start within {START_TIMEOUT_S:.0f} s")
        try:
            self._proc.stdin.write(msgpack.packb(list(args), use_bin_type=True))
            self._proc.stdin.flush()
        except OSError:
            self._restart()
            raise SandboxError("regen_crashed", "the worker died (killed, or out of memory)") from None
        reply = self._receive(time.monotonic() + timeout)
        if reply is None:
            self._restart()
            raise SandboxError("regen_timeout", "no answer within the deadline; the worker was killed")
        if reply[0] == "error":
            raise SandboxError(reply[1], reply[2])
        return reply[1]

    def _receive(self, deadline: float) -> list | None:
        """The worker's next message, or None at the deadline."""
        fd = self._proc.stdout.fileno()
        while True:
            for msg in self._unpacker:
                return msg
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                self._restart()
                raise SandboxError("regen_crashed", "the worker died (killed, or out of memory)")
            self._unpacker.feed(chunk)

    def _restart(self) -> None:
        self.restarts += 1
        self.close()
        self.start()

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait(5)
            for pipe in (proc.stdin, proc.stdout):
                pipe.close()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
