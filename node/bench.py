"""`sapo doctor --bench`: a few real rounds of the configured model on this machine, once per generation
backend that can run here, measured against what the memory planner expected. A plan is an estimate made
from configs; this is the measurement a home-GPU owner can attach to a bug report, and the one that says
when the estimate was wrong.

Each backend runs as its own `sapo run` (gossip and status server off, in a scratch folder), so that its
memory is its own and the figures are those of a real node: the parent touches no GPU until they end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from node.progress import print_table

EVAL_TASKS = 8  # the run's held-out evaluation (round 0 and the last round) is not what is measured: keep it short
TOLERANCE_UNDER = 0.5  # a peak below this share of the plan: the planner asks far more than a round needs
LOG_TAIL = 40
STOP_WAIT_S = 120  # a node's step may take this long to finish after it is asked to stop


@dataclass
class Verdict:
    kind: str  # "held", "under" (the round needed more than planned) or "over" (far less)
    line: str


def judge(peak_gb: float | None, planned_gb: float) -> Verdict:
    """Whether the plan's expected peak matched the measured one, said plainly either way."""
    if peak_gb is None:
        return Verdict("unknown", "peak memory cannot be read on this system")
    if peak_gb > planned_gb:
        return Verdict("under", f"the planner's estimate was wrong: a round peaked at {peak_gb:.2f} GB, past the "
                                f"{planned_gb:.2f} GB it planned (+{peak_gb / planned_gb - 1:.0%}); a node lowers its "
                                "micro-batch when this happens, and a card with less to spare can run out of memory")
    if peak_gb < TOLERANCE_UNDER * planned_gb:
        return Verdict("over", f"a round peaked at {peak_gb:.2f} GB, {peak_gb / planned_gb:.0%} of the {planned_gb:.2f} GB "
                               "planned: below the plan by design (it is for the worst round, every completion at "
                               "max_new_tokens, and counts a fixed share for the interpreter), though this far below "
                               "it may refuse or shrink configurations this device could run")
    return Verdict("held", f"the plan held: peak {peak_gb:.2f} GB of the {planned_gb:.2f} GB planned")


def summarize(rows: list[dict], plan: dict, completions: int, max_new_tokens: int) -> dict:
    """A backend's figures from its run's metrics rows (round 0, the warm-up round 1 and rounds with an
    evaluation are left out of the steady figures). A plan is made for the worst round, every completion
    running to max_new_tokens; the rounds measured say how far from it they were."""
    trained = [r for r in rows if r["round"] >= 1]
    steady = [r for r in trained[1:] if r["eval_accuracy"] is None] or trained[1:] or trained

    def mean(key: str) -> float:
        return sum(r[key] for r in steady) / len(steady)

    def seconds(r: dict) -> float:
        return r["seconds_generate"] + r["seconds_train"] + r["seconds_other"]

    round_s = sum(map(seconds, steady)) / len(steady)
    peaks = [r["memory_peak_gb"] for r in trained if r.get("memory_peak_gb") is not None]
    peak = round(max(peaks), 3) if peaks else None  # judged as reported: near a threshold, the same verdict
    verdict = judge(peak, plan["peak_gb"])
    groups = mean("n_local") + mean("n_external")
    length = mean("tokens_generated") / max(groups * completions, 1)
    line = verdict.line
    if verdict.kind == "over" and length < 0.9 * max_new_tokens:
        line += (f" (the plan is for completions of {max_new_tokens} tokens; these averaged {length:.0f}, so "
                 "longer answers need more of it)")
    return {
        "rounds": len(trained), "steady_rounds": [r["round"] for r in steady],
        "groups_per_round": round(groups, 2), "completions_per_group": completions, "max_new_tokens": max_new_tokens,
        "tokens_per_completion": round(length, 1),
        "first_round_s": round(seconds(trained[0]), 2),
        "round_s": round(round_s, 3), "rounds_per_minute": round(60 / round_s, 3),
        "generate_s": round(mean("seconds_generate"), 3), "train_s": round(mean("seconds_train"), 3),
        # what the training phase is made of: only groups that carry signal train, so runs compare per group (None for
        # metrics written before nodes recorded it)
        "groups_trained_per_round": (None if any("groups_trained" not in r for r in steady)
                                     else round(mean("groups_trained"), 2)),
        "push_s": round(mean("seconds_push"), 4),
        "generated_tokens_per_s": round(sum(r["tokens_generated"] for r in steady)
                                        / max(sum(r["seconds_generate"] for r in steady), 1e-9), 1),
        "micro_batch": [r["micro_batch"] for r in trained],
        "peak_gb": peak, "planned_peak_gb": plan["peak_gb"],
        "plan": plan, "verdict": verdict.kind, "verdict_line": line,
    }


def _failure(code: int, log: str) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        return f"killed by {name}" + (" (the kernel's out-of-memory killer?)" if -code == signal.SIGKILL else "")
    said = [line for line in log.splitlines() if line.startswith("sapo:")]
    last = said[-1] if said else next((line for line in reversed(log.splitlines()) if line.strip()), "")
    return f"exited with {code}: {last.strip()}"


def run_backend(argv: list[str], backend: str, rounds: int, folder: Path, timeout_s: float,
                console: Console) -> dict:
    """One `sapo run` of `rounds` rounds on `backend` in `folder`; its summary, or its failure with the log's end."""
    cmd = [sys.executable, "-m", "node.cli", "run", *argv, "--generation.backend", backend,
           "--run.rounds", str(rounds), "--run.eval_every", str(rounds), "--run.checkpoint_every", str(rounds),
           "--tasks.eval_size", str(EVAL_TASKS), "--p2p.enabled", "false", "--status.enabled", "false",
           "--run.out_dir", str(folder)]
    log_path, metrics = folder / "bench.log", folder / "metrics.jsonl"
    folder.mkdir(parents=True)
    started, timed_out = time.monotonic(), False
    with open(log_path, "w") as log, console.status(f"{backend}: starting") as status:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"})
        try:
            while child.poll() is None and not (timed_out := time.monotonic() - started > timeout_s):
                done = len(metrics.read_text().splitlines()) - 1 if metrics.exists() else -1
                status.update(f"{backend}: {'loading the model' if done < 0 else f'round {done} of {rounds} done'}")
                time.sleep(0.5)
            if timed_out:
                child.terminate()  # the node's own stop: its step ends and a checkpoint is written (discarded here)
        finally:
            try:  # after a timeout or a Ctrl-C (which the child got too): its stop time, then no more
                child.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    seconds = round(time.monotonic() - started, 1)
    log_text = log_path.read_text(errors="replace")
    result = {"backend": backend, "seconds": seconds, "command": cmd[1:]}
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if timed_out or child.returncode != 0 or not any(r["round"] >= 1 for r in rows):
        why = f"not done within {timeout_s:.0f} s" if timed_out else _failure(child.returncode, log_text)
        return {**result, "ok": False, "error": why, "log_tail": log_text.splitlines()[-LOG_TAIL:]}
    return {**result, "ok": True, **measured(folder, rows)}


def measured(folder: Path, rows: list[dict]) -> dict:
    """`summarize` for a node's run folder: its plan and its config as the node ran them (the plan applied)."""
    plan = json.loads((folder / "plan.json").read_text())
    ran = json.loads((folder / "config.json").read_text())["generation"]
    return summarize(rows, plan, ran["completions_per_group"], ran["max_new_tokens"])


def bench(argv: list[str], model: str, rounds: int, out: Path, timeout_s: float, console: Console | None = None) -> int:
    """Run every backend that can run here, print the figures, save them to `out`; 0 when all ran."""
    from node.doctor import machine
    from trainer.generation import vllm_available

    console = console or Console()
    backends = ["transformers", *(["vllm"] if vllm_available() else [])]
    console.print(f"sapo doctor --bench: {rounds} rounds of {model} on each of: {', '.join(backends)}")
    with tempfile.TemporaryDirectory(prefix="sapo-bench-") as scratch:
        results = [run_backend(argv, b, rounds, Path(scratch) / b, timeout_s, console) for b in backends]
    rows = machine()  # after the runs: reading a card's free memory opens a CUDA context the runs would share

    table = Table(title=f"sapo doctor --bench: {model}", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True)
    for column in ("backend", "rounds/min", "gen s", "train s", "groups trained", "push s", "tok/s", "peak GB", "plan GB"):
        table.add_column(column, justify="left" if column == "backend" else "right", no_wrap=True, min_width=len(column))
    for r in results:
        if r["ok"]:
            groups = r["groups_trained_per_round"]
            table.add_row(r["backend"], f"{r['rounds_per_minute']:.2f}", f"{r['generate_s']:.2f}", f"{r['train_s']:.2f}",
                          "-" if groups is None else f"{groups:.2f}", f"{r['push_s']:.3f}", f"{r['generated_tokens_per_s']:.0f}",
                          "-" if r["peak_gb"] is None else f"{r['peak_gb']:.2f}", f"{r['planned_peak_gb']:.2f}")
        else:
            table.add_row(r["backend"], "failed", *["-"] * 7)
    print_table(console, table)
    for r in results:
        line = r["verdict_line"] if r["ok"] else f"failed: {r['error']}"
        console.print(escape(f"{r['backend']}: {line}"), soft_wrap=True)
        if r["ok"]:
            console.print(escape(f"  plan: {r['plan']['summary']}"), soft_wrap=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "rounds": rounds, "machine": dict(rows), "time": time.time(),
                               "backends": results}, indent=2))
    console.print(escape(f"saved {out} (attach it to a bug report)"), soft_wrap=True)  # a path to copy, unbroken
    return 0 if all(r["ok"] for r in results) else 1

