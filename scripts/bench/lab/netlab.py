"""A network lab of Linux namespaces: each host in a namespace of its own, all joined through a middle
namespace (the lab's internet), some behind a home router (nftables) of one of three kinds (`NatKind`), the middle's
forwarding optionally slowed and made lossy by scripts/bench/lab/lossy_link.py. Nothing is routed outside the
namespaces; `close` kills what the lab started and deletes every namespace it made.

Addresses: host i sits on 198.18.i.0/24 (the middle is .1, the host or its router .2), a range that
stands for the internet here (nodes treat it as public); behind a NAT the home network is
192.168.i.0/24 (router .1, host .2). A router that maps ports (miniupnpd, `add_host(upnp=True)` or `natpmp=True`)
sits on 11.18.i.0/24 instead: miniupnpd refuses to map ports on a reserved address such as 198.18/15, and 11/8,
public space elsewhere, is this lab's own inside its namespaces (nothing is routed out of them).
`python -m scripts.bench.lab.netlab echo|ping` is the lab's UDP round-trip probe, run inside a namespace; `accept`
the open host's TCP listener; `observe`, `map`, `dial` and `punch` measure what a router does to TCP (the mapping
an observer sees, what gets in, a simultaneous open through two routers), and `punch-bench` counts raw punches.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import selectors
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[3]
UPNP_NFT = """table inet filter {
  chain miniupnpd {
  }
  chain prerouting_miniupnpd {
  }
  chain postrouting_miniupnpd {
  }
  chain forward {
    type filter hook forward priority 0; policy accept;
    jump miniupnpd
  }
  chain prerouting {
    type nat hook prerouting priority -100; policy accept;
    jump prerouting_miniupnpd
  }
  chain postrouting {
    type nat hook postrouting priority 100; policy accept;
    jump postrouting_miniupnpd
  }
}
"""  # the chains miniupnpd (nftables build) adds its rules to, by its default names
ACCEPT_PORT = 9  # add_open_host: every port is redirected here, where connections are accepted and closed
TABLE = "100"  # the middle's routing table that sends every forwarded packet through the lossy link
STEALTH_NFT = """table ip stealth {
  chain input {
    type filter hook input priority 0; policy accept;
    iifname "wan" ct state new drop
  }
}
"""  # a router that drops what it did not expect from the internet before conntrack keeps it: no reset, no state
EIM_SHIFT = 10000  # an `eim` router sends home port P out as P + EIM_SHIFT (wrapping within 1024-65535)


class NatKind(str, Enum):
    """How a home router maps a home host's connections onto its one public address. Hole punching works when the
    port an observer saw is the port the next peer will see, so the kinds differ exactly there; all three filter
    inbound by conntrack alone (replies to a flow the home opened get in, nothing else does)."""

    MASQUERADE = "masquerade"  # Linux's own: the home's port kept while it is free, whatever the destination
    EIM = "eim"  # endpoint-independent mapping that moves the port: P always leaves as eim_port(P)
    SYMMETRIC = "symmetric"  # a random port for every new connection: what an observer saw tells a peer nothing


def eim_port(port: int) -> int:
    """The external port an `eim` router gives home port `port` (1024 and up): a bijection, so every home port keeps
    one mapping of its own."""
    return 1024 + (port - 1024 + EIM_SHIFT) % (65536 - 1024)


def nat_rules(kind: NatKind, external: str) -> str:
    """The router's nftables NAT table for `kind`, its public address `external` on interface wan. The eim router's
    explicit map covers every port from 1024 (a 64k-entry map loads in about 0.3 s); the rest (ICMP, lower ports)
    is masqueraded."""
    rules = {NatKind.MASQUERADE: 'oifname "wan" masquerade',
             NatKind.SYMMETRIC: 'oifname "wan" masquerade random,fully-random',
             NatKind.EIM: (f'oifname "wan" meta l4proto {{ tcp, udp }} th sport >= 1024 snat ip to {external} : '
                           'th sport map @eim\n  oifname "wan" masquerade')}[kind]
    ports = ", ".join(f"{p} : {eim_port(p)}" for p in range(1024, 65536)) if kind is NatKind.EIM else ""
    eim_map = f" map eim {{\n  type inet_service : inet_service\n  elements = {{ {ports} }}\n }}\n" if ports else ""
    return f"table ip nat {{\n{eim_map} chain post {{\n  type nat hook postrouting priority 100;\n  {rules}\n }}\n}}\n"


def run(*cmd: str, stdin: str | None = None) -> None:
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")


def unavailable() -> str | None:
    """Why this machine cannot run the lab, or None."""
    missing = [tool for tool in ("ip", "nft") if shutil.which(tool) is None]
    if missing:
        return f"missing {' and '.join(missing)} (Debian: apt-get install iproute2 nftables)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun (the lossy link needs a TUN device)"
    name = f"sapo-check-{os.getpid()}"
    try:
        run("ip", "netns", "add", name)
    except RuntimeError as e:
        return f"cannot create a network namespace: {e}"
    run("ip", "netns", "del", name)
    return None


@dataclass
class LabHost:
    ns: str
    ip: str  # its own address
    seen_as: str  # the address the rest of the lab sees its connections come from (its router's, behind NAT)

    def cmd(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]


@dataclass
class Lab:
    workdir: Path
    delay_ms: float = 0.0  # one way, through the middle
    loss: float = 0.0  # per packet, through the middle
    prefix: str = field(default_factory=lambda: f"sapo{os.getpid() % 100000}")
    hosts: list[LabHost] = field(default_factory=list)
    lans: list[list[LabHost]] = field(default_factory=list)
    routers: dict[int, str] = field(default_factory=dict)  # host index -> its router namespace, where miniupnpd runs
    namespaces: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def middle(self) -> str:
        return f"{self.prefix}-mid"

    @property
    def impaired(self) -> bool:
        return self.delay_ms > 0 or self.loss > 0

    def __enter__(self) -> Lab:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._netns(self.middle)
        self._sysctl(self.middle, "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
                     "net.ipv4.conf.default.rp_filter=0")
        if self.impaired:
            run("ip", "-n", self.middle, "tuntap", "add", "dev", "lossy", "mode", "tun")
            run("ip", "-n", self.middle, "link", "set", "lossy", "up")
            run("ip", "-n", self.middle, "route", "add", "default", "dev", "lossy", "table", TABLE)
            stats = self.workdir / "lossy-link.json"
            self.procs.append(subprocess.Popen(
                ["ip", "netns", "exec", self.middle, sys.executable, str(Path(__file__).with_name("lossy_link.py")),
                 "--dev", "lossy", "--delay-ms", str(self.delay_ms), "--loss", str(self.loss), "--stats", str(stats)],
                stderr=open(self.workdir / "lossy-link.log", "ab")))
            deadline = time.monotonic() + 10
            while not stats.exists():
                if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                    raise RuntimeError(f"the lossy link did not start: {(self.workdir / 'lossy-link.log').read_text()}")
                time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(self, nat: bool | NatKind | str = False, upnp: bool = False, natpmp: bool = False,
                 stealth: bool = False) -> LabHost:
        """A host on the lab's internet, or behind a home router (`nat`: a NatKind or its name, True for
        masquerade) that maps ports on request with `upnp` (UPnP IGD) or `natpmp` (NAT-PMP), or both (miniupnpd).
        A router answers a connection it did not expect with a reset (as Linux does with no firewall, and OpenWrt's
        default REJECT), or with `stealth` drops it unanswered (RFC 5382 REQ-4): a reset that meets a punch's SYN
        before the home's own SYN has left kills that attempt (docs/bench/netlab-raw-punch-2cpu.json)."""
        kind = NatKind.MASQUERADE if nat is True else NatKind(nat) if nat else None
        i = len(self.hosts) + 1
        ns = f"{self.prefix}-h{i}"
        edge = f"{self.prefix}-r{i}" if nat else ns  # the namespace on the middle's link
        net = f"11.18.{i}" if upnp or natpmp else f"198.18.{i}"
        self._netns(ns)
        if nat:
            self._netns(edge)
        self._link(self.middle, f"m{i}", f"{net}.1", edge, "wan", f"{net}.2")
        if self.impaired:  # forwarded packets from this link go through the lossy link, back out by the main table
            run("ip", "-n", self.middle, "rule", "add", "iif", f"m{i}", "lookup", TABLE)
        if nat:
            self._sysctl(edge, "net.ipv4.ip_forward=1")
            self._link(edge, "lan", f"192.168.{i}.1", ns, "eth0", f"192.168.{i}.2")
            run("ip", "-n", edge, "route", "add", "default", "via", f"{net}.1")
            run("ip", "-n", ns, "route", "add", "default", "via", f"192.168.{i}.1")
            run("ip", "netns", "exec", edge, "nft", "-f", "-", stdin=nat_rules(kind, f"{net}.2"))
            if stealth:
                run("ip", "netns", "exec", edge, "nft", "-f", "-", stdin=STEALTH_NFT)
            host = LabHost(ns, f"192.168.{i}.2", f"{net}.2")
            if upnp or natpmp:
                self._upnp(edge, host.seen_as, i, upnp, natpmp)
        else:
            run("ip", "-n", ns, "route", "add", "default", "via", f"{net}.1")
            host = LabHost(ns, f"{net}.2", f"{net}.2")
        self.hosts.append(host)
        return host

    def _upnp(self, router: str, external: str, i: int, upnp: bool, natpmp: bool) -> None:
        """miniupnpd on the router `router`, speaking UPnP IGD and/or NAT-PMP: the nftables chains it fills (its
        defaults' names), a config that lets the home network map ports 1024 and up to itself, and the daemon, in the
        foreground, logged."""
        run("ip", "netns", "exec", router, "nft", "-f", "-", stdin=UPNP_NFT)
        conf = self.workdir / f"miniupnpd-{i}.conf"
        yes = {True: "yes", False: "no"}
        conf.write_text(f"ext_ifname=wan\nlistening_ip=lan\next_ip={external}\nhttp_port=5000\nenable_natpmp={yes[natpmp]}\n"
                        f"enable_upnp={yes[upnp]}\nsecure_mode=yes\nsystem_uptime=yes\nuuid=3d3cec3a-8cf0-11e0-98ee-00000000000{i % 10}\n"
                        f"allow 1024-65535 192.168.{i}.0/24 1024-65535\ndeny 0-65535 0.0.0.0/0 0-65535\n")
        log = self.workdir / f"miniupnpd-{i}.log"
        self.procs.append(subprocess.Popen(["ip", "netns", "exec", router, "miniupnpd", "-d", "-f", str(conf)],
                                           stdout=open(log, "ab"), stderr=subprocess.STDOUT))
        self.routers[i] = router

    def mappings(self, host_index: int) -> str:
        """The port mappings the router of host `host_index` (1-based) holds: its nftables DNAT chain."""
        done = subprocess.run(["ip", "netns", "exec", self.routers[host_index], "nft", "list", "chain", "inet", "filter",
                               "prerouting_miniupnpd"], capture_output=True, text=True, timeout=30)
        return done.stdout

    def add_open_host(self, addresses: int) -> list[str]:
        """A host at `addresses` addresses (198.18.i.10 and up) that accepts a TCP connection on every port and
        closes it at once: what a liar may name as peers (the hosts of others), each dial reaching TCP and failing
        the handshake. Returns its addresses."""
        host = self.add_host()
        i = len(self.hosts)
        ips = [f"198.18.{i}.{10 + k}" for k in range(addresses)]
        for ip in ips:
            run("ip", "-n", host.ns, "addr", "add", f"{ip}/32", "dev", "wan")
        run("ip", "netns", "exec", host.ns, "nft", "-f", "-", stdin=(
            f"table ip nat {{\n chain pre {{\n  type nat hook prerouting priority -100;\n"
            f"  tcp dport != {ACCEPT_PORT} redirect to :{ACCEPT_PORT}\n }}\n}}\n"))
        self.procs.append(subprocess.Popen(host.cmd(sys.executable, "-m", "scripts.bench.lab.netlab", "accept",
                                                    str(ACCEPT_PORT)), cwd=ROOT))
        return ips

    def syn_counter(self, host: LabHost, target: str) -> Callable[[], int]:
        """Count the TCP connections `host` opens to `target` from now on (SYNs leaving it, in its packet filter):
        every attempt, whichever code in the host made it. Returns the reader."""
        run("ip", "netns", "exec", host.ns, "nft", "-f", "-", stdin=(
            "table ip sapo_count {\n chain out {\n  type filter hook output priority 0;\n"
            f"  ip daddr {target} tcp flags & (syn | ack) == syn counter\n }}\n}}\n"))

        def read() -> int:
            done = subprocess.run(host.cmd("nft", "-j", "list", "table", "ip", "sapo_count"), capture_output=True,
                                  text=True, timeout=30, check=True)
            return next(e["rule"]["expr"][-1]["counter"]["packets"] for e in json.loads(done.stdout)["nftables"]
                        if "rule" in e)
        return read

    def add_lan(self, n: int) -> list[LabHost]:
        """`n` hosts on one Ethernet segment (a bridge in a namespace of its own), 10.77.<lan>.0/24 with no router
        and no way out: a home's LAN, where multicast (mDNS) reaches every host."""
        k = len(self.lans) + 1
        bridge = f"{self.prefix}-lan{k}"
        self._netns(bridge)
        run("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", bridge, "link", "set", "br0", "up")
        hosts = []
        for j in range(1, n + 1):
            ns, ip = f"{self.prefix}-l{k}h{j}", f"10.77.{k}.{j + 1}"
            self._netns(ns)
            run("ip", "link", "add", "name", f"p{j}", "netns", bridge, "type", "veth", "peer", "name", "eth0", "netns", ns)
            run("ip", "-n", bridge, "link", "set", f"p{j}", "master", "br0", "up")
            run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
            run("ip", "-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")  # multicast out of the LAN interface
            hosts.append(LabHost(ns, ip, ip))
        self.lans.append(hosts)
        return hosts

    def link_counts(self) -> dict[str, int]:
        """Packets the lossy link forwarded and dropped so far (it rewrites the file every second)."""
        return json.loads((self.workdir / "lossy-link.json").read_text())

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.namespaces.clear()

    def _netns(self, ns: str) -> None:
        run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        run("ip", "-n", ns, "link", "set", "lo", "up")

    @staticmethod
    def _sysctl(ns: str, *settings: str) -> None:
        run("ip", "netns", "exec", ns, "sysctl", "-qw", *settings)

    @staticmethod
    def _link(ns_a: str, dev_a: str, ip_a: str, ns_b: str, dev_b: str, ip_b: str) -> None:
        run("ip", "link", "add", "name", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b)
        for ns, dev, ip in ((ns_a, dev_a, ip_a), (ns_b, dev_b, ip_b)):
            run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            run("ip", "-n", ns, "link", "set", dev, "up")


def ping(host: LabHost, target: str, port: int, count: int, interval_s: float) -> dict[str, float]:
    """UDP round trips from `host` to an echo at target:port: fastest, median and p95 in ms, and the share lost."""
    out = subprocess.run(host.cmd(sys.executable, "-m", "scripts.bench.lab.netlab", "ping", target, str(port), str(count),
                                  str(interval_s)), cwd=ROOT, capture_output=True, text=True, timeout=count * interval_s + 30)
    if out.returncode:
        raise RuntimeError(f"ping from {host.ns} failed: {out.stderr.strip()}")
    return json.loads(out.stdout)


def echo(host: LabHost, port: int) -> subprocess.Popen:
    return subprocess.Popen(host.cmd(sys.executable, "-m", "scripts.bench.lab.netlab", "echo", host.ip, str(port)), cwd=ROOT)


def _echo(ip: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((ip, port))
        while True:
            data, addr = s.recvfrom(2048)
            s.sendto(data, addr)


def _accept(port: int) -> None:
    with socket.create_server(("0.0.0.0", port), backlog=128) as s:
        while True:
            conn, _ = s.accept()
            conn.close()


def _ping(target: str, port: int, count: int, interval_s: float) -> None:
    sent: dict[int, float] = {}
    rtts: list[float] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        start = time.monotonic()
        end = start + count * interval_s + 2.0  # the last replies' time to come back
        n = 0
        while time.monotonic() < end:
            if n < count and time.monotonic() >= start + n * interval_s:
                sent[n] = time.monotonic()
                s.sendto(n.to_bytes(4, "big") + bytes(60), (target, port))
                n += 1
            try:
                data, _ = s.recvfrom(2048)
                rtts.append(1000 * (time.monotonic() - sent.pop(int.from_bytes(data[:4], "big"))))
            except (BlockingIOError, KeyError):
                time.sleep(0.0005)
    rtts.sort()
    print(json.dumps({"min_ms": rtts[0] if rtts else float("nan"),
                      "median_ms": statistics.median(rtts) if rtts else float("nan"),
                      "p95_ms": rtts[int(0.95 * len(rtts))] if rtts else float("nan"),
                      "lost": 1 - len(rtts) / count}))


OBSERVER_PORT = 7000  # where `observe` listens
PEER_WAIT_S = 20.0  # how long the observer holds a client for its peer, and a client for the observer
HOLD_S = 120.0  # the longest the observer keeps a client's connection (and so its router's mapping) open
OBSERVER_CLIENTS = 64  # connections the observer serves at once; more are closed and counted
OBSERVER_NAMES = 1024  # registrations it remembers, the oldest forgotten first
LINE_MAX = 512  # bytes in one protocol line (JSON); a longer one is bad input
ATTEMPT_S = 2.0  # one connect() of a punch before it is given up: its SYN and the first retransmission (1 s)
RETRY_S = 0.2  # the pause after a refused connect() before the next
PUNCH_PORT = 20000  # punch-bench's first home port; run k uses PUNCH_PORT + k, so no run meets an earlier one's state


def _bound(ip: str, port: int) -> socket.socket:
    """A TCP socket on ip:port that other sockets may share (SO_REUSEADDR and SO_REUSEPORT, as libp2p's TCP
    transport sets them to punch): the listener, the observer's connection and the punch leave from one port, so a
    router that can keeps one mapping for them all."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((ip, port))
    return s


@dataclass
class Lines:
    """A TCP connection that carries one JSON object a line, each at most LINE_MAX bytes."""

    sock: socket.socket
    rfile: BinaryIO = field(init=False)

    def __post_init__(self) -> None:
        self.rfile = self.sock.makefile("rb")

    def send(self, message: dict) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def read(self, timeout_s: float) -> dict:
        """The next line's object within `timeout_s`; ValueError for anything else (too long, not JSON, cut off)."""
        self.sock.settimeout(timeout_s)
        line = self.rfile.readline(LINE_MAX + 1)
        if not line.endswith(b"\n"):
            raise ValueError("a line cut off or too long")
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError("not an object")
        return message

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()


def _address(text: str) -> tuple[str, int]:
    ip, port = text.rsplit(":", 1)
    return ip, int(port)


@dataclass
class Observer:
    """`observe`: tells each client the address:port its connection came from (what libp2p's identify reports as
    the observed address), and, when it names a peer, that peer's once it has registered too. Both clients of a pair
    hear the other's address within a few ms of each other, which starts their punch together."""

    seen: dict[str, str] = field(default_factory=dict)  # a client's name -> the address it was seen at
    clients: int = 0
    bad: int = 0  # hellos that were not one JSON line with a name, and clients over OBSERVER_CLIENTS
    cond: threading.Condition = field(default_factory=threading.Condition)

    def serve(self, ip: str, port: int) -> None:
        with socket.create_server((ip, port), backlog=128) as server:
            print(json.dumps({"listening": f"{ip}:{port}"}), flush=True)
            while True:
                conn, addr = server.accept()
                with self.cond:
                    full = self.clients >= OBSERVER_CLIENTS
                    self.clients += not full
                    self.bad += full
                if full:
                    conn.close()
                else:  # no Nagle: a peer's address must not wait for the ACK of the line before it (a round trip)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    threading.Thread(target=self._client, args=(conn, addr), daemon=True).start()

    def _client(self, conn: socket.socket, addr: tuple[str, int]) -> None:
        here, lines = f"{addr[0]}:{addr[1]}", Lines(conn)
        try:
            with conn:
                try:
                    hello = lines.read(PEER_WAIT_S)
                    name, peer = str(hello["name"]), hello.get("peer")
                except (ValueError, KeyError) as e:
                    with self.cond:
                        self.bad += 1
                    log.warning("observer: bad hello from %s (%s), %d so far", here, e, self.bad)
                    return
                with self.cond:
                    self.seen[name] = here
                    if len(self.seen) > OBSERVER_NAMES:
                        del self.seen[next(iter(self.seen))]
                    self.cond.notify_all()
                lines.send({"seen": here})
                if peer is not None:
                    with self.cond:
                        there = self.seen.get(str(peer)) if self.cond.wait_for(lambda: str(peer) in self.seen,
                                                                                PEER_WAIT_S) else None
                    lines.send({"peer": there} if there else {"error": f"{peer} did not register"})
                conn.settimeout(HOLD_S)
                conn.recv(1)  # hold the connection, and the client's mapping, until the client is done
        except OSError:
            pass  # a client gone or silent: nothing to answer
        finally:
            lines.close()
            with self.cond:
                self.clients -= 1


def _hello(ip: str, port: int, observer: str, name: str, peer: str | None = None) -> tuple[Lines, dict]:
    """Connect from ip:port to the observer, register as `name`, and return the connection (kept open: it holds the
    router's mapping, as a relay connection would) and the observer's first answer."""
    sock = _bound(ip, port)
    sock.settimeout(PEER_WAIT_S)
    sock.connect(_address(observer))
    lines = Lines(sock)
    lines.send({"name": name} | ({"peer": peer} if peer else {}))
    return lines, lines.read(PEER_WAIT_S)


def _map(ip: str, port: int, observers: list[str], hold_s: float) -> None:
    """From one home port, ask each observer what it sees and print that; then, with the observers' connections (and
    so the mappings) open, listen on the port until stdin closes (at most `hold_s`), and print whatever got in."""
    with _bound(ip, port) as listener, selectors.DefaultSelector() as sel:
        listener.listen(8)
        held = [_hello(ip, port, obs, f"map-{ip}:{port}-{k}") for k, obs in enumerate(observers)]
        print(json.dumps({"seen": [answer["seen"] for _, answer in held]}), flush=True)
        sel.register(listener, selectors.EVENT_READ)
        sel.register(sys.stdin, selectors.EVENT_READ)
        accepted: list[str] = []
        end = time.monotonic() + hold_s
        while (left := end - time.monotonic()) > 0:
            ready = [key.fileobj for key, _ in sel.select(left)]
            if sys.stdin in ready:
                break
            if ready:
                conn, addr = listener.accept()
                accepted.append(f"{addr[0]}:{addr[1]}")
                conn.close()
        for lines, _ in held:
            lines.close()
        print(json.dumps({"accepted": accepted}), flush=True)


def _dial(target: str, timeout_s: float) -> None:
    try:
        socket.create_connection(_address(target), timeout=timeout_s).close()
        print(json.dumps({"connected": True, "error": None}))
    except OSError as e:
        print(json.dumps({"connected": False, "error": type(e).__name__}))


def _connect_until(ip: str, port: int, target: tuple[str, int], timeout_s: float) -> tuple[socket.socket | None, dict]:
    """TCP simultaneous open from ip:port to `target` (the other home's router, as the observer saw it), with the
    port's listener open too: connect(), and again after each refusal or ATTEMPT_S of silence, until a connection
    with the target exists (made by connect(), or accepted when the other's SYN arrived between two attempts) or
    `timeout_s` has passed. Returns the connection or None, and what happened."""
    errors: list[str] = []
    with _bound(ip, port) as listener, selectors.DefaultSelector() as sel:
        listener.listen(8)
        listener.setblocking(False)
        sel.register(listener, selectors.EVENT_READ)
        start = time.monotonic()
        deadline = start + timeout_s
        while time.monotonic() < deadline:
            attempt = _bound(ip, port)
            attempt.setblocking(False)
            attempt.connect_ex(target)
            sel.register(attempt, selectors.EVENT_WRITE)
            end, pending = min(deadline, time.monotonic() + ATTEMPT_S), True
            while (left := end - time.monotonic()) > 0:
                for key, _ in sel.select(left):
                    if key.fileobj is listener:
                        conn, addr = listener.accept()
                        if addr == target:
                            if pending:
                                sel.unregister(attempt)
                            attempt.close()
                            return conn, {"via": "accept", "seconds": time.monotonic() - start,
                                          "attempts": len(errors) + 1, "errors": errors}
                        conn.close()
                    elif code := attempt.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                        errors.append(os.strerror(code))
                        sel.unregister(attempt)
                        pending, end = False, min(deadline, time.monotonic() + RETRY_S)
                    else:
                        sel.unregister(attempt)
                        return attempt, {"via": "connect", "seconds": time.monotonic() - start,
                                         "attempts": len(errors) + 1, "errors": errors}
            if pending:
                errors.append("timed out")
                sel.unregister(attempt)
            attempt.close()
    return None, {"via": None, "seconds": timeout_s, "attempts": len(errors), "errors": errors}


def _punch(ip: str, port: int, observer: str, name: str, peer: str, timeout_s: float, skew_s: float) -> None:
    """One raw TCP hole punch, as DCUtR makes it over a relay: learn this side's and the peer's external address
    from the observer, then (`skew_s` later: one side late, as DCUtR's timing misses by) open towards the peer's
    until it connects or `timeout_s` passes; the two sides trade names over the connection to prove it reaches the
    peer. Prints the outcome as JSON."""
    result: dict = {"ok": False, "external": None, "peer": None}
    try:
        lines, answer = _hello(ip, port, observer, name, peer)
        try:
            result["external"] = answer["seen"]
            told = lines.read(PEER_WAIT_S)
            if not told.get("peer"):
                raise ValueError(told.get("error", "no peer address"))
            result["peer"] = told["peer"]
            time.sleep(skew_s)
            result["started"] = time.time()  # the two sides' clocks are one machine's: their difference is the skew
            conn, outcome = _connect_until(ip, port, _address(told["peer"]), timeout_s)
            result |= outcome
            if conn is not None:
                punched = Lines(conn)
                try:
                    punched.send({"name": name})
                    result["ok"] = punched.read(PEER_WAIT_S).get("name") == peer
                finally:
                    punched.close()
        finally:
            lines.close()
    except (OSError, ValueError, KeyError) as e:
        result["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(result), flush=True)


def observe(host: LabHost, port: int = OBSERVER_PORT) -> subprocess.Popen:
    """The observer on `host`, listening once this returns."""
    proc = subprocess.Popen(host.cmd(sys.executable, "-m", "scripts.bench.lab.netlab", "observe", host.ip, str(port)),
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if not proc.stdout.readline():
        raise RuntimeError(f"the observer on {host.ns} exited with {proc.wait()}")
    return proc


def dial(host: LabHost, target: str, timeout_s: float) -> dict:
    """One TCP connection from `host` to target (ip:port), closed at once: whether it was made, else why not."""
    out = subprocess.run(host.cmd(sys.executable, "-m", "scripts.bench.lab.netlab", "dial", target, str(timeout_s)),
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout_s + 30, check=True)
    return json.loads(out.stdout)


def punch(a: LabHost, b: LabHost, observer: str, port: int, tag: str, timeout_s: float,
          skew_s: float = 0.0) -> list[dict]:
    """A raw punch between home hosts `a` and `b`, both from `port`, started together through the observer
    (ip:port), `b` `skew_s` late; each side's outcome (`_punch`)."""
    procs = [subprocess.Popen(host.cmd(sys.executable, "-m", "scripts.bench.lab.netlab", "punch", host.ip, str(port),
                                       observer, f"{tag}-{me}", f"{tag}-{other}", str(timeout_s), "--skew", str(skew)),
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for host, me, other, skew in ((a, "a", "b", 0.0), (b, "b", "a", skew_s))]
    try:
        return [json.loads(proc.communicate(timeout=2 * PEER_WAIT_S + timeout_s + 30)[0]) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def punch_bench(kinds: list[NatKind], paths: list[tuple[float, float]], n: int, timeout_s: float) -> dict:
    """`n` raw punches between two home hosts behind routers of each kind, once answering unexpected SYNs with a
    reset and once stealthy, over each path (round trip in ms, loss per packet each way, through the middle), each
    punch from a fresh port; the success count, how many took one connect(), the times, and the skew between the
    two sides' first connect() of each punch that succeeded and failed."""
    report: dict = {"n": n, "timeout_s": timeout_s, "kernel": os.uname().release, "paths": []}
    for rtt_ms, loss in paths:
        routers: dict = {}
        with tempfile.TemporaryDirectory() as tmp, Lab(Path(tmp), delay_ms=rtt_ms / 2, loss=loss) as lab:
            public = lab.add_host()
            lab.procs.append(observe(public))
            for kind in kinds:
                for stealth in (False, True):
                    name = f"{kind.value}{'-stealth' if stealth else ''}"
                    a, b = lab.add_host(kind, stealth=stealth), lab.add_host(kind, stealth=stealth)
                    runs = [punch(a, b, f"{public.ip}:{OBSERVER_PORT}", PUNCH_PORT + k, f"{name}{k}", timeout_s)
                            for k in range(n)]
                    routers[name] = punch_summary(runs)
                    log.info("%g ms, %g loss, %s: %d of %d punched", rtt_ms, loss, name, routers[name]["succeeded"], n)
        report["paths"].append({"rtt_ms": rtt_ms, "loss": loss, "routers": routers})
    return report


def punch_summary(runs: list[list[dict]]) -> dict:
    """Of raw punches (each a pair of sides' reports): how many succeeded, how many on the first connect(), their
    times, and the skew between the sides' first connect() of those that succeeded and failed."""
    ok = [all(side["ok"] for side in pair) for pair in runs]
    times = sorted(max(side["seconds"] for side in pair) for pair, good in zip(runs, ok) if good)
    skews = [round(1000 * abs(pair[0]["started"] - pair[1]["started"]))
             if all("started" in side for side in pair) else None for pair in runs]
    return {"succeeded": len(times),
            "first_attempt": sum(all(side["ok"] and side["attempts"] == 1 for side in pair) for pair in runs),
            "median_s": statistics.median(times) if times else None, "max_s": times[-1] if times else None,
            "skew_ms_succeeded": sorted(k for k, good in zip(skews, ok) if good and k is not None),
            "skew_ms_failed": sorted(k for k, good in zip(skews, ok) if not good and k is not None),
            "runs": runs}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.lab.netlab", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("echo", allow_abbrev=False, help="a UDP echo on ip:port")
    p.add_argument("ip")
    p.add_argument("port", type=int)
    p = sub.add_parser("accept", allow_abbrev=False, help="accept TCP connections on every address's port and close them")
    p.add_argument("port", type=int)
    p = sub.add_parser("ping", allow_abbrev=False, help="UDP round trips to an echo")
    p.add_argument("target")
    p.add_argument("port", type=int)
    p.add_argument("count", type=int)
    p.add_argument("interval_s", type=float)
    p = sub.add_parser("observe", allow_abbrev=False, help="tell TCP clients the address they come from, and their peer's")
    p.add_argument("ip")
    p.add_argument("port", type=int)
    p = sub.add_parser("map", allow_abbrev=False, help="the external addresses observers see for one home port, then what gets in "
                       "until stdin closes")
    p.add_argument("ip")
    p.add_argument("port", type=int)
    p.add_argument("hold_s", type=float)
    p.add_argument("observers", nargs="+", help="ip:port of each observer")
    p = sub.add_parser("dial", allow_abbrev=False, help="one TCP connection to ip:port")
    p.add_argument("target")
    p.add_argument("timeout_s", type=float)
    p = sub.add_parser("punch", allow_abbrev=False, help="one raw TCP hole punch (simultaneous open) to the peer the observer names")
    p.add_argument("ip")
    p.add_argument("port", type=int)
    p.add_argument("observer", help="ip:port")
    p.add_argument("name")
    p.add_argument("peer")
    p.add_argument("timeout_s", type=float)
    p.add_argument("--skew", type=float, default=0.0, help="seconds to wait before the first connect()")
    p = sub.add_parser("punch-bench", allow_abbrev=False, help="count raw punches between two homes behind routers of each kind (root)")
    p.add_argument("--kind", nargs="+", type=NatKind, default=list(NatKind), help="router kinds (default: all)")
    p.add_argument("--n", type=int, default=20, help="punches per kind")
    p.add_argument("--timeout", type=float, default=6.0, help="seconds one punch may take")
    p.add_argument("--path", nargs=2, type=float, action="append", metavar=("RTT_MS", "LOSS"),
                   help="a round trip and a loss per packet through the middle (repeatable; default 100 0.01)")
    p.add_argument("--out", type=Path, required=True, help="the JSON report")
    args = parser.parse_args(argv)
    if args.command == "echo":
        _echo(args.ip, args.port)
    elif args.command == "accept":
        _accept(args.port)
    elif args.command == "ping":
        _ping(args.target, args.port, args.count, args.interval_s)
    elif args.command == "observe":
        Observer().serve(args.ip, args.port)
    elif args.command == "map":
        _map(args.ip, args.port, args.observers, args.hold_s)
    elif args.command == "dial":
        _dial(args.target, args.timeout_s)
    elif args.command == "punch":
        _punch(args.ip, args.port, args.observer, args.name, args.peer, args.timeout_s, args.skew)
    else:
        if why := unavailable():
            parser.error(f"network lab: {why}")
        report = punch_bench(args.kind, [tuple(path) for path in args.path or [(100.0, 0.01)]], args.n, args.timeout)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        for path in report["paths"]:
            print(json.dumps({"rtt_ms": path["rtt_ms"], "loss": path["loss"]} | {
                name: {k: v for k, v in r.items() if k != "runs"} for name, r in path["routers"].items()}))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main(sys.argv[1:])
