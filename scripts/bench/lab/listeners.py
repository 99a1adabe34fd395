"""Listening sockets that stand for made-up hosts: every connection is counted, with its time and the process that
opened it, and closed at once, so a libp2p dial of a made-up peer there fails the way a dial of someone else's host
would."""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from pathlib import Path


def socket_owner(ip: str, port: int, pids: set[int]) -> int | None:
    """Which of `pids` holds the TCP socket bound at `ip:port` on this machine (IPv4), if any: the dialing end of a
    connection on loopback, found through /proc/net/tcp's inode and the processes' open files."""
    want = f"{socket.inet_aton(ip)[::-1].hex().upper()}:{port:04X}"
    inodes = {line.split()[9] for line in Path("/proc/net/tcp").read_text().splitlines()[1:] if line.split()[1] == want}
    for pid in pids:
        try:
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # the process has ended
            continue
        if any(fd[8:-1] in inodes for fd in fds if fd.startswith("socket:[")):
            return pid
    return None


class ConnectionCounter:
    """One listener on each of `hosts` (loopback addresses), on a free port; `addrs` their multiaddrs, `times` when
    each connection came, `count` how many, and `owners` which of the processes in `watch` (pids, which a caller may
    add to) opened each (None: another)."""

    def __init__(self, hosts: list[str]):
        self.servers = [socket.create_server((h, 0)) for h in hosts]
        self.addrs = [f"/ip4/{h}/tcp/{s.getsockname()[1]}" for h, s in zip(hosts, self.servers)]
        self.times: list[float] = []
        self.owners: list[int | None] = []
        self.watch: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def count(self) -> int:
        return len(self.times)

    def by_minute(self, start: float, end: float, owner: int | None = None) -> list[int]:
        """Connections (opened by `owner`, if given) in each whole minute from `start` (time.time()) up to `end`."""
        return [sum(1 for t, o in zip(self.times, self.owners) if start + 60 * m <= t < start + 60 * (m + 1)
                    and owner in (None, o)) for m in range(int((end - start) // 60))]

    def _accept(self) -> None:
        while not self._stop.is_set():
            for server in select.select(self.servers, [], [], 0.2)[0]:  # all at once: close() waits for one pass
                conn, (ip, port) = server.accept()
                self.owners.append(socket_owner(ip, port, self.watch) if self.watch else None)
                conn.close()
                self.times.append(time.time())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for server in self.servers:
            server.close()
