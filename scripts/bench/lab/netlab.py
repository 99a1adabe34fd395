"""A network lab of Linux namespaces: each host in a namespace of its own, all joined through a middle
namespace (the lab's internet), some behind a home router that masquerades (nftables), the middle's
forwarding optionally slowed and made lossy by scripts/bench/lab/lossy_link.py. Nothing is routed outside the
namespaces; `close` kills what the lab started and deletes every namespace it made.

Addresses: host i sits on 198.18.i.0/24 (the middle is .1, the host or its router .2), a range that
stands for the internet here (nodes treat it as public); behind a NAT the home network is
192.168.i.0/24 (router .1, host .2). A router that maps ports (miniupnpd, `add_host(upnp=True)` or `natpmp=True`)
sits on 11.18.i.0/24 instead: miniupnpd refuses to map ports on a reserved address such as 198.18/15, and 11/8,
public space elsewhere, is this lab's own inside its namespaces (nothing is routed out of them).
`python -m scripts.bench.lab.netlab echo|ping` is the lab's UDP round-trip probe, run inside a namespace; `accept`
the open host's TCP listener.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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

    def add_host(self, nat: bool = False, upnp: bool = False, natpmp: bool = False) -> LabHost:
        """A host on the lab's internet, or behind a home router that masquerades (`nat`) and maps ports on request
        with `upnp` (UPnP IGD) or `natpmp` (NAT-PMP), or both (miniupnpd)."""
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
            run("ip", "netns", "exec", edge, "nft", "-f", "-", stdin=(
                "table ip nat {\n chain post {\n  type nat hook postrouting priority 100;\n  oifname \"wan\" masquerade\n }\n}\n"))
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


if __name__ == "__main__":
    if sys.argv[1] == "echo":
        _echo(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "accept":
        _accept(int(sys.argv[2]))
    else:
        _ping(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
