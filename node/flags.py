"""The flags of `sapo run`, shared by every command that takes them (`sapo run`, `sapo doctor`, `sapo swarm
--node-args`): every config knob is `--<section>.<field> VALUE`, the common ones also have a short form.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from node.config import ConfigError, NodeConfig, leaf_fields, load_config, shown_default

# Short flags for the knobs people change most; each is also reachable under its dotted name.
ALIASES = {
    "--model": "model.name",
    "--out": "run.out_dir",
    "--rounds": "run.rounds",
    "--local": "run.local_groups",
    "--external": "selection.external_groups",
    "--seed": "run.seed",
    "--tasks": "tasks.datasets",
    "--bootstrap": "p2p.bootstrap",
    "--listen": "p2p.listen",
    "--network": "p2p.network",
}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML or YAML config file (env SAPO_* and flags override it)")
    for flag, dotted in ALIASES.items():
        parser.add_argument(flag, dest=dotted, default=argparse.SUPPRESS, metavar="VALUE", help=f"same as --{dotted}")
    group = parser.add_argument_group("config knobs (see docs/CONFIG.md)")
    for dotted, info in leaf_fields(NodeConfig):
        help_text = f"{info.description or ''} [default: {shown_default(dotted, info)}]".strip()
        group.add_argument(f"--{dotted}", dest=dotted, default=argparse.SUPPRESS, metavar="VALUE",
                           help=help_text.replace("%", "%%"))


def config_argv(args: argparse.Namespace) -> list[str]:
    """The config flags given, as a command line for a child `sapo run`."""
    argv = ["--config", str(args.config)] if args.config else []
    for dotted, raw in vars(args).items():
        if "." in dotted:
            argv += [f"--{dotted}", raw]
    return argv


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Nest dotted CLI values; JSON lists/objects are parsed, 'null' means None, the rest stays text for pydantic."""
    nested: dict[str, Any] = {}
    for dotted, raw in vars(args).items():
        if "." not in dotted:
            continue
        value: Any = raw
        if raw.strip()[:1] in "[{":
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{dotted}: not valid JSON ({e.msg}) (got {raw!r})") from None
        elif raw.strip() == "null":  # not "none": that is a valid choice of some knobs
            value = None
        section, _, key = dotted.rpartition(".")
        target = nested
        for part in section.split("."):
            target = target.setdefault(part, {})
        target[key] = value
    return nested


class NodeArgsParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage dump and exit
        raise ConfigError(f"--node-args: {message}")


def _parsed(argv: list[str]) -> argparse.Namespace:
    parser = NodeArgsParser(prog="sapo swarm --node-args", add_help=False)
    add_config_flags(parser)
    return parser.parse_args(argv)


def config_from_flags(argv: list[str]) -> NodeConfig:
    """The config a `sapo run` with these flags would run (`ConfigError` on a bad one)."""
    flags = _parsed(argv)
    return load_config(flags.config, overrides(flags))


def flag_settings(argv: list[str]) -> set[str]:
    """The dotted settings these `sapo run` flags set."""
    return {dotted for dotted in vars(_parsed(argv)) if "." in dotted}
