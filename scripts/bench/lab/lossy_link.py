"""A slow, lossy link for the network lab: IP packets routed into a TUN device come back out of it
after --delay-ms, each dropped with probability --loss.

This kernel has no `tc netem` ("Specified qdisc kind is unknown"), so the lab's middle namespace
routes every packet it forwards through this process instead; the kernels at both ends see a real
path with latency and loss, and TCP retransmits as it would on the internet. Run inside the
namespace that holds the device (created beforehand with `ip tuntap add mode tun`). Counts of
forwarded and dropped packets go to --stats as JSON on exit and every second.

    ip netns exec lab-wan python scripts/bench/lab/lossy_link.py --dev lossy --delay-ms 50 --loss 0.01
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import json
import os
import random
import select
import signal
import struct
import time
from pathlib import Path

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--dev", required=True, help="TUN device to attach to (must exist in this namespace)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="added to every packet, one way")
    p.add_argument("--loss", type=float, default=0.0, help="probability that a packet is dropped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stats", type=Path, help="JSON file of counts, rewritten every second")
    args = p.parse_args()
    if not 0 <= args.loss < 1 or args.delay_ms < 0:
        p.error("--loss must be in [0, 1) and --delay-ms >= 0")

    fd = open_tun(args.dev)
    rng = random.Random(args.seed)
    delay = args.delay_ms / 1000
    queue: list[tuple[float, int, bytes]] = []  # (due, arrival number, packet): one delay keeps the order
    counts = {"forwarded": 0, "dropped": 0}
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    next_report = 0.0
    while not stopping:
        now = time.monotonic()
        timeout = max(0.0, min(queue[0][0] - now if queue else 1.0, 1.0))
        try:
            readable, _, _ = select.select([fd], [], [], timeout)
        except InterruptedError:
            continue
        now = time.monotonic()
        while readable:
            try:
                packet = os.read(fd, 65536)
            except BlockingIOError:
                break
            if rng.random() < args.loss:
                counts["dropped"] += 1
            else:  # due from its own read: one stamp for the whole drain let a packet that came in while this
                # process was descheduled mid-drain out early (a round trip of 97.6 ms on a 100 ms path, under load)
                heapq.heappush(queue, (time.monotonic() + delay, counts["forwarded"] + counts["dropped"], packet))
                counts["forwarded"] += 1
        while queue and queue[0][0] <= now:
            os.write(fd, heapq.heappop(queue)[2])
        if args.stats and now >= next_report:
            args.stats.write_text(json.dumps(counts))
            next_report = now + 1.0
    if args.stats:
        args.stats.write_text(json.dumps(counts))


if __name__ == "__main__":
    main()
