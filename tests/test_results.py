"""Every figure of the README's Results table, and of the paragraph after it, read back from the JSON it comes from
(as tests/test_plan.py keeps docs/gpu.md's plan table equal to the planner's): a changed number in either fails.

RESULTS maps each row (by text of its "what" cell) to its figures, one line each: the file under docs/bench the
figure comes from (a tuple: several files, passed in that order) and how the figure reads from it, formatted as the
README prints it. Reads JSON only, and one figure is computed as its write-up says: the planner's step estimates
(`trainer.plan.step_peak` on each JSON's step shape, docs/bench/memory.md)."""

from __future__ import annotations

import json
import re
import statistics
from functools import cache

import pytest

from experiment.paired import ci95, mde
from experiment.report import held_out_gap
from tests.conftest import ROOT

BENCH = ROOT / "docs" / "bench"
PARAGRAPH = "The paper's +94% is not reached"  # the paragraph after the table, checked as a row



@cache
def load(path: str) -> dict:
    return json.loads((BENCH / path).read_text())


# --- reading the files -------------------------------------------------------------------------------------------

def arm(d: dict, config: str) -> dict:
    """A configuration's row of a sapo_experiment.py report (results.json or the older single files)."""
    (row,) = [c for c in d["configs"] if c["config"] == config]
    return row


def runs(d: dict, config: str) -> dict[int, dict]:
    return {r["seed"]: r for r in d["runs"] if r["config"] == config}


def node(run: dict, name: str) -> dict:
    (n,) = [n for n in run["nodes"] if n["name"] == name or n["model"] == name]
    return n


def per_seed(d: dict, config: str, other: str, name: str, key: str, dataset: str) -> list[float]:
    """Node `name`'s last `key` accuracy on `dataset` in `config` minus the same node's in `other`, seed by seed."""
    ours, theirs = runs(d, config), runs(d, other)
    return [node(ours[s], name)[f"{key}_by_dataset_last"][dataset] - node(theirs[s], name)[f"{key}_by_dataset_last"][dataset]
            for s in sorted(ours) if s in theirs]


def rpm(d: dict) -> float:
    """Rounds per minute of a `sapo doctor --bench` JSON's transformers backend."""
    (b,) = [b for b in d["backends"] if b["backend"] == "transformers"]
    return b["rounds_per_minute"]


def step_estimate(d: dict) -> float:
    """The planner's estimate today, in GB, for the step a bench_round.py --own-prompts JSON measured, computed as
    docs/bench/memory.md says (and tests/test_plan.py holds within a fifth above the measured peak)."""
    from tests.test_plan import GEMMA3_270M, SMOLLM2
    from trainer.memory import GB
    from trainer.plan import step_peak

    (row,) = d["rows"]
    part = row["largest_part"]
    config = {"smollm2-135m": SMOLLM2, "gemma3-270m": GEMMA3_270M}[d["model"]]
    return step_peak(config, row["variant"], part["rows"], part["positions"] / part["rows"],
                     round(d["prompt_tokens"] / d["tasks"]), ("q_proj", "k_proj", "v_proj", "o_proj")) / GB


def relay_ids(d: dict, hostile: int) -> float:
    (run,) = [r for r in d["runs"] if r["hostile"] == hostile]
    return run["phases"]["attack"]["relayed_mib_per_s"]


# --- formatting as the README prints ------------------------------------------------------------------------------

def pct(x: float) -> str:
    return "±0.0%" if x == 0 else f"{100 * x:+.1f}%"


def vs_silo(c: dict) -> str:
    return f"{pct(c['vs_silo'])} ± {100 * c['vs_silo_ci95']:.1f}"


def gap(g: float, ci: float) -> str:
    return f"{g:+.3f} ± {ci:.3f}"


def stats(g: dict) -> str:
    return gap(g["gap"], g["ci95"])


def held(c: dict) -> str:
    return gap(c["eval_last_vs_silo"], c["eval_last_vs_silo_ci95"])


def gaps(xs: list[float]) -> str:
    return gap(statistics.mean(xs), ci95(xs))


def spread(xs, fmt: str, sep: str = " to ") -> str:
    return f"{fmt.format(min(xs))}{sep}{fmt.format(max(xs))}"


def clear(g: float, ci: float, no: str, yes: str) -> str:
    """The verdict a figure states beside its interval."""
    return no if abs(g) < ci else yes


def the(values) -> object:
    """The one value all of `values` share (a text that matches no figure when they differ)."""
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else f"one of {sorted(distinct)}"


# --- the files -----------------------------------------------------------------------------------------------------

EXP, GUARDED, TRIED = "sapo-experiment-2cpu.json", "sapo-experiment-guarded-2cpu.json", "sapo-experiment-guarded-tried-2cpu.json"
HETERO, GEMMA, REAL = "hetero-2cpu/results.json", "gemma-smollm2-2cpu/results.json", "real-grid-2cpu/results.json"
GPU, STEP = "gpu-grid-h100/results.json", "step-size-40-2cpu/results.json"
SPEC, NF4 = "specialists-2cpu/results.json", "nf4-check-2cpu/results.json"
OWNERS = "owners-2cpu/owners.json"
DOCTOR_PAIRS = tuple(f"decode-step-doctor-ab-2cpu/{k}-{which}.json" for k in (1, 2, 3) for which in ("current", "at-1e47067"))
DOCTOR_2CPU, DOCTOR_H200 = "doctor-bench-smollm2-135m-2cpu.json", "doctor-bench-h200/recipe.json"
STEPS = tuple(f"round-smollm2-135m-own-prompts-{run}-2cpu.json" for run in ("mb8", "lora-mb8", "nf4-mb8"))
GEMMA_STEP = "round-gemma3-270m-own-prompts-mb8-2cpu.json"
CONTENTION = ("contention-smollm2-135m-2cpu.json", "contention-repeat-smollm2-135m-2cpu.json")
ONE_THREAD = "contention-one-thread-smollm2-135m-2cpu.json"
HOSTILE = {case: (f"hostile-{case}-before-2cpu.json", f"hostile-{case}-after-2cpu.json")
           for case in ("relay-computable", "relay-ids", "level-computable", "px-aim-redials", "dht-eclipse", "dht-flood",
                        "dialback-liar", "level-forward")}

# --- figures that take more than a line ----------------------------------------------------------------------------

HETERO_ARMS = ("demo 4/4 signal", "demo 4/4 guarded", "demo 4/4 scoped", "demo 4/4 guarded peer_tasks")
GEMMA_SWARMS = [f"gemma+smollm2 2/2 {rule} [{model}]" for rule in ("guarded", "scoped") for model in ("gemma3-270m", "smollm2-135m")]
SPEC_SWARM, SPEC_ALONE, SPEC_UNION = "specialists 2/2 guarded", "specialists 4/0", "specialists-union 4/0"


def hetero_rules(d: dict) -> str:
    """Each rule against `guarded`, paired by seed: whether any differs, and the smallest effect detectable."""
    others = [arm(d, a)["vs_default"]["reward"] for a in HETERO_ARMS if a != "demo 4/4 guarded"]
    verdict = "no rule differs" if all(abs(v["gap"]) < v["ci95"] for v in others) else "a rule differs"
    return f"{verdict} from `guarded` (detectable: {spread([100 * v['mde'] for v in others], '{:.1f}', '-')}%)"


def gemma_means(d: dict) -> str:
    gaps_ = [arm(d, a)["expected_vs_silo"]["all"]["gap"] for a in GEMMA_SWARMS]
    return f"{'neither' if min(gaps_) >= 0 else 'one'} below its silo on the means (expected held-out {spread(gaps_, '{:+.3f}')})"


def gemma_arith(d: dict, rule: str) -> str:
    return f"{stats(arm(d, f'gemma+smollm2 2/2 {rule} [gemma3-270m]')['expected_vs_silo']['node0 arith'])} under `{rule}`"


def gemma_arith_up(d: dict) -> str:
    """Gemma's `arith` against its silo, seed by seed, under both rules."""
    ups = [per_seed(d, f"gemma+smollm2 2/2 {rule}", "gemma+smollm2 4/0", "gemma3-270m", "expected", "arith")
           for rule in ("scoped", "guarded")]
    if not all(g > 0 for up in ups for g in up):
        return "not up in every seed"
    return (f"up in each of {the(map(len, ups))} seeds under both rules: {sum(map(len, ups))} swarm runs, paired with "
            f"the same {len(runs(d, 'gemma+smollm2 4/0'))} silo runs")


def gemma_rules(d: dict) -> str:
    v = arm(d, "gemma+smollm2 2/2 scoped")["vs_default"]["held_out"]
    return f"`scoped` vs `guarded` {stats(v)} held-out: {clear(v['gap'], v['ci95'], 'no difference', 'a difference')}"


def pair_held_out(d: dict) -> str:
    s, g = arm(d, "smollm2 2/2 signal"), arm(d, "smollm2 2/2 guarded")
    moved = any(abs(c["eval_last_vs_silo"]) >= c["eval_last_vs_silo_ci95"] for c in (s, g))
    return f"held-out {held(s)} and {held(g)}: {'moved' if moved else 'not moved'}"


def weaker_peer(d: dict) -> str:
    c = arm(d, "smollm2+tiny 2/2 signal")
    hurts = c["eval_last_vs_silo"] + c["eval_last_vs_silo_ci95"] < 0
    return f"under `signal` {vs_silo(c)}, held-out {held(c)}: {'a weaker peer hurts' if hurts else 'no harm shown'}"


def as_alone(c: dict) -> str:
    """A node beside tiny-a that used none of its groups ran its silo node's run: every gap exactly zero."""
    same = c["vs_silo"] == c["vs_silo_ci95"] == c["eval_last_vs_silo"] == c["eval_vs_silo_worst"] == 0
    return f"{pct(c['vs_silo'])}: {'it ran exactly as alone' if same else 'it differed from alone'}"


def gpu_pair(d: dict) -> str:
    c = arm(d, "smollm2 4/4 guarded")
    return f"{vs_silo(c)} (held-out {held(c)}: {clear(c['eval_last_vs_silo'], c['eval_last_vs_silo_ci95'], 'not clear of zero', 'clear of zero')})"


def busy_shares(d: dict, code: str) -> list[float]:
    """Each repeat's rounds a minute beside the busy loops over the same repeat's idle ones, for one checkout."""
    pace = {(r["repeat"], r["busy"]): r["rounds_per_minute"] for r in d["runs"] if r["code"] == code}
    return [pace[rep, busy] / pace[rep, 0] for rep, busy in pace if busy]


def idle_rpm(d: dict) -> float:
    return statistics.mean(r["rounds_per_minute"] for r in d["runs"] if r["busy"] == 0)


def contention(first: dict, repeat: dict) -> str:
    """The five pairs of the code that follows free cores: the first run's (beside the code before) and the repeat's."""
    before, after = first["command"][first["command"].index("--code") + 1:][:2]
    now = busy_shares(first, after)
    shares = now + busy_shares(repeat, repeat["runs"][0]["code"])
    return (f"{statistics.mean(shares):.2f} ± {ci95(shares):.2f} of its idle rounds per minute over {len(shares)} pairs "
            f"(the run beside the code before: {statistics.mean(now):.2f}, where torch's 2 fixed threads kept "
            f"{statistics.mean(busy_shares(first, before)):.2f})")


def doctor_pairs(*ds: dict) -> str:
    """Three pairs taking turns: the current code, then 1e47067's float32 sampler."""
    now, then = ds[0::2], ds[1::2]
    return (" / ".join(f"{rpm(d):.2f}" for d in now) + " rounds per minute, "
            + " / ".join(f"{rpm(a) / rpm(b):.2f}x" for a, b in zip(now, then)) + " the float32 sampler of 1e47067")


def no_collapse(d: dict) -> str:
    c = arm(d, "smollm2-adapt 4/0 lr 0.0001")
    finals = [n["eval_last"] for r in runs(d, c["config"]).values() for n in r["nodes"]]
    verdict = "no collapse in any seed" if min(finals) > c["eval_first"] else "a collapse"
    return f"{verdict} ({spread(finals, '{:.3f}')})"


def specialist_a(d: dict) -> str:
    """A's products accuracy in the swarm and alone, at the last round, and where both started."""
    swarm, alone = runs(d, SPEC_SWARM).values(), runs(d, SPEC_ALONE).values()
    last = [statistics.mean(node(r, "node0")["expected_by_dataset_last"]["rg/products"] for r in arm_runs)
            for arm_runs in (swarm, alone)]
    first = the(node(r, "node0")["expected_by_dataset_first"]["rg/products"] for r in [*swarm, *alone])
    return (f"A in the swarm {last[0]:.2f} against A alone {last[1]:.2f}, both at round "
            f"{the(r['rounds'] for r in [*swarm, *alone])}, both from {first:.3f} at round 0")


def specialist_a_own(d: dict) -> str:
    a, b = (arm(d, SPEC_SWARM)["expected_vs_silo"][f"node0 {family}"] for family in ("arith", "rg/basic_arithmetic"))
    seen = "no effect seen" if abs(a["gap"]) < a["ci95"] and abs(b["gap"]) < b["ci95"] else "an effect"
    return (f"A's own families {a['gap']:+.3f} / {b['gap']:+.3f}, {seen} (intervals down to {a['gap'] - a['ci95']:+.3f} / "
            f"{b['gap'] - b['ci95']:+.3f}")


def specialist_union(d: dict) -> str:
    u = per_seed(d, SPEC_SWARM, SPEC_UNION, "node0", "expected", "rg/products")
    return f"A's products {gaps(u)}: {clear(statistics.mean(u), ci95(u), 'no difference detected', 'a difference')} (detectable {mde(u):.2f})"


def owners_row(d: dict, arm: str, against: str, measure: str = "expected", endpoint: str = "taught") -> dict:
    (row,) = [r for r in d["comparisons"] if (r["arm"], r["against"], r["measure"], r["endpoint"]) == (arm, against, measure, endpoint)]
    return row


def owners_gap(d: dict, *which: str, **named: str) -> str:
    return held_out_gap(owners_row(d, *which, **named))


def owners_seeds(d: dict, against: str) -> object:
    """How many seeds the swarm's comparisons with `against` pair on."""
    return the(r["seeds"] for r in d["comparisons"] if r["arm"] == "swarm" and r["against"] == against)


def owners_fewer(d: dict, arm: str, than: str) -> str:
    """How many fewer tokens a node of `arm` generated than one of `than`, in percent, over the seeds they pair on."""
    (row,) = [r for r in d["comparisons"] if (r["measure"], r["endpoint"]) == ("expected", "taught")
              and {r["arm"], r["against"]} == {arm, than}]
    mine, other = (row["tokens_per_node"]["ours"], row["tokens_per_node"]["theirs"])[::1 if row["arm"] == arm else -1]
    return f"{100 * (1 - mine / other):.0f}%"


def owners_added(d: dict) -> str:
    """The one-sentence verdict: the swarm against the union silo that trains on every family at the same groups, by
    sampled (expected) and by greedy accuracy."""
    def beyond(measure: str) -> str:
        row = owners_row(d, "swarm", "union", measure)
        return clear(row["gap"], row["ci95"], "none", "a gain" if row["gap"] > 0 else "a loss")
    return (f"sharing taught each owner what training on all four families itself teaches, from {owners_fewer(d, 'swarm', 'union')} "
            f"less generation; beyond that, {beyond('expected')} in sampled answers and {beyond('greedy')} in greedy ones")


def level_grind(before: dict, after: dict) -> str:
    """The shard level strangers ground a node into, before the rule and after, and in how many seeds."""
    reached = max(s["deepest_level_attack"] for s in before["summary"])
    stayed = max(s[f"deepest_level_{phase}"] for s in after["summary"] for phase in ("before", "attack", "after"))
    seeds = sum(b["deepest_level_attack"] == reached and max(a["deepest_level_attack"], a["deepest_level_after"]) == stayed
                for b, a in zip(before["summary"], after["summary"]))
    return (f"{the(s['hostile'] for s in before['summary'] + after['summary'])} ids ground into a node's shard from one "
            f"address take it to level {reached} -> it stays at {stayed} ({seeds} of {len(after['summary'])} seeds)")


def redials(before: dict, after: dict) -> str:
    (b,), (a,) = before["summary"], after["summary"]
    return (f"connection attempts at liars' hosts in the {the(s['after_s'] / 60 for s in (b, a)):.0f} minutes after they "
            f"left {b['attempts_at_hinted_host_after']} -> {a['attempts_at_hinted_host_after']}")


def dht_meet(before: dict, after: dict) -> str:
    """When the second node first heard the first, beside three hostile DHT servers flooding providers."""
    (b,), (a,) = before["runs"], after["runs"]
    met = lambda r: "never" if r["met_s"] is None else f"after {r['met_s']:.1f} s"  # noqa: E731
    return f"two nodes beside three hostile DHT servers near the key meet {met(b)} -> {met(a)}"


def dht_dials(kind: str):
    """The most connections one node opened to the hostile servers' made-up hosts in the run."""
    def figure(before: dict, after: dict) -> str:
        (b,), (a,) = before["runs"], after["runs"]
        most = lambda r: max(r["connections_by_node"].values())  # noqa: E731
        return (f"connections by one node to their made-up hosts in {the(r['window_s'] / 60 for r in (b, a)):.0f} "
                f"minutes ({kind}) {most(b)} -> {most(a)}")
    return figure


def liar_believed(before: dict, after: dict) -> str:
    """How long a node behind NAT believed a dial-back liar's "reached"."""
    b, a = ([r for r in d["runs"] if r["lie"] == "reached"][0] for d in (before, after))
    return (f"a node behind NAT believes a dial-back liar's \"reached\" for {b['believed_public_s']} -> "
            f"{a['believed_public_s']} of {the(r['window_s'] for r in (b, a)):.0f} s")


def forwarded(before: dict, after: dict) -> str:
    """The deepest level twelve forwarded ground ids took a training node to."""
    (b,), (a,) = before["summary"], after["summary"]
    return (f"12 ground ids forwarded by one stranger take a node to level {b['deepest_level_attack']} -> "
            f"{a['deepest_level_attack']}")


# --- the table, row by row: (text of the row's "what" cell, [(file or files, the figure as the README prints it)]) --

RESULTS = [
    ("4 tiny nodes, 4 local + 4 external groups under `signal`", [
        (EXP, lambda d: f"{vs_silo(arm(d, 'homogeneous 4/4 signal'))} cumulative reward")]),
    ("the same, 2 local + 6 external", [
        (EXP, lambda d: vs_silo(arm(d, "homogeneous 2/6 signal")))]),
    ("controls: the silo drawing 16 tasks", [
        (EXP, lambda d: f"{vs_silo(arm(d, 'homogeneous 8/0 overdraw 2'))} / {vs_silo(arm(d, 'homogeneous control 4+4 own'))}")]),
    ("mixed tiny models (two architectures and tokenizers)", [
        (EXP, lambda d: vs_silo(arm(d, "heterogeneous 4/4 signal")))]),
    ("the `guarded` sampling rule (the default), tiny 4/4, 5 seeds", [
        (GUARDED, lambda d: f"{vs_silo(arm(d, 'homogeneous 4/4 guarded'))} (held-out"),
        (GUARDED, lambda d: f"held-out {arm(d, 'homogeneous 4/4 guarded')['eval_last']:.3f} vs "
                            f"{arm(d, 'homogeneous 4/4 signal')['eval_last']:.3f} under `signal`"),
        (GUARDED, lambda d: f"{len(arm(d, 'homogeneous 4/4 guarded')['seeds'])} seeds"),
        (TRIED, lambda d: f"re-run on shared cores {vs_silo(arm(d, 'homogeneous 4/4 guarded'))}")]),
    ("the demo's mixed tiny swarm (tiny-a, tiny-b, tiny-a)", [
        (HETERO, lambda d: spread([100 * arm(d, a)["vs_silo"] for a in HETERO_ARMS], "{:+.1f}%") + " each"),
        (HETERO, lambda d: f"tiny-b held-out {spread([arm(d, f'{a} [tiny-b]')['eval_last_vs_silo'] for a in HETERO_ARMS], '{:+.2f}')}"),
        (HETERO, hetero_rules)]),
    ("Gemma 3 270M beside SmolLM2-135M", [
        (GEMMA, gemma_means),
        (GEMMA, lambda d: gemma_arith(d, "scoped")),
        (GEMMA, lambda d: gemma_arith(d, "guarded")),
        (GEMMA, gemma_arith_up),
        (GEMMA, gemma_rules)]),
    ("two SmolLM2-135M nodes, 2/2 vs 4/0, 2 CPU cores", [
        (REAL, lambda d: f"{vs_silo(arm(d, 'smollm2 2/2 signal'))} under `signal`, {vs_silo(arm(d, 'smollm2 2/2 guarded'))} under `guarded`"),
        (REAL, pair_held_out)]),
    ("SmolLM2-135M beside a tiny node, 2/2", [
        (REAL, weaker_peer),
        (REAL, lambda d: f"under `guarded` {as_alone(arm(d, 'smollm2+tiny 2/2 guarded'))}")]),
    ("two SmolLM2-135M nodes, 4/4 vs 8/0 under `guarded`, on one H100", [
        (GPU, gpu_pair),
        (GPU, lambda d: f"beside tiny-a {pct(arm(d, 'smollm2+tiny 4/4 guarded')['vs_silo'])}: it used "
                        f"{'none' if arm(d, 'smollm2+tiny 4/4 guarded')['external_used_per_round'] == 0 else 'some'} of its groups")]),
    ("SmolLM2-135M round as a node runs it", [
        (DOCTOR_PAIRS, doctor_pairs),
        (DOCTOR_2CPU, lambda d: f"with the float32 sampler, before the copies: {rpm(d):.2f} on 2 cores"),
        (DOCTOR_H200, lambda d: f"on an NVIDIA H200: {rpm(d):.1f}")]),
    ("SmolLM2-135M's recipe round beside two busy loops on 2 cores", [
        (CONTENTION, contention),
        ((CONTENTION[1], ONE_THREAD), lambda two, one: "a one-thread node's ceiling there: "
                                                       f"{2 / 3 * idle_rpm(one) / idle_rpm(two):.2f}")]),
    ("training step at micro-batch 8, every row its own prompt", [
        (STEPS + (GEMMA_STEP,), lambda *ds: f"micro-batch {the(d['rows'][0]['micro_batch'] for d in ds)}, every row its own prompt"
            if all(d["rows"][0]["own_prompts"] for d in ds) else "not every row its own prompt"),
        (STEPS, lambda *ds: "peak " + " / ".join(f"{d['rows'][0]['peak_rss_gb']:.2f}" for d in ds) + " GB"),
        (GEMMA_STEP, lambda d: f"Gemma {d['rows'][0]['peak_rss_gb']:.2f} GB;"),
        (STEPS, lambda *ds: "fifth above) " + " / ".join(f"{step_estimate(d):.2f}" for d in ds) + " GB"),
        (GEMMA_STEP, lambda d: f"Gemma {step_estimate(d):.2f} GB |")]),
    ("the step-size controller, each model alone", [
        (STEP, lambda d: f"plain folder: held-out {arm(d, 'gemma-adapt 4/0')['eval_first']:.3f} -> {arm(d, 'gemma-adapt 4/0')['eval_last']:.3f}"),
        (STEP, lambda d: f"-> {arm(d, 'gemma-fixed 4/0 lr 6.7e-06')['eval_last']:.3f}, "
                         f"{'one seed' if len(arm(d, 'gemma-fixed 4/0 lr 6.7e-06')['seeds']) == 1 else 'seeds'}"),
        (STEP, lambda d: f"from 1e-4: {arm(d, 'smollm2-adapt 4/0 lr 0.0001')['eval_first']:.3f} -> "
                         f"{arm(d, 'smollm2-adapt 4/0 lr 0.0001')['eval_last']:.3f}"),
        (STEP, no_collapse),
        (STEP, lambda d: f"at SmolLM2's recipe {held(arm(d, 'smollm2-adapt 4/0'))} against the fixed rate: "
                         + clear(arm(d, "smollm2-adapt 4/0")["eval_last_vs_silo"], arm(d, "smollm2-adapt 4/0")["eval_last_vs_silo_ci95"],
                                 "no difference detected", "a difference"))]),
    ("two SmolLM2-135M specialists (A: arithmetic, B: products)", [
        (SPEC, lambda d: f"{stats(arm(d, SPEC_SWARM)['expected_vs_silo']['node0 rg/products'])} over A alone"),
        (SPEC, specialist_a),
        (SPEC, lambda d: f"greedy {gaps(per_seed(d, SPEC_SWARM, SPEC_ALONE, 'node0', 'eval', 'rg/products'))}"),
        (SPEC, lambda d: f"B's on arith {stats(arm(d, SPEC_SWARM)['expected_vs_silo']['node1 arith'])} "
                         f"(greedy {gaps(per_seed(d, SPEC_SWARM, SPEC_ALONE, 'node1', 'eval', 'arith'))})"),
        (SPEC, specialist_a_own),
        (SPEC, specialist_union),
        (SPEC, lambda d: f"at {100 * (1 - arm(d, SPEC_SWARM)['tokens_per_node'] / arm(d, SPEC_UNION)['tokens_per_node']):.0f}% "
                         "fewer generated tokens")]),
    ("four SmolLM2-135M owners, each drawing one family of four", [
        (OWNERS, lambda d: f"({d['rounds']} rounds; seeds: {owners_seeds(d, 'alone')} against alone, {owners_seeds(d, 'union_tokens')} "
                           f"against the union silo at 2 groups a round, {owners_seeds(d, 'union')} against the one at 4;"),
        (OWNERS, owners_added),
        (OWNERS, lambda d: f"never draws {owners_gap(d, 'swarm', 'alone')} over it alone "
                           f"(greedy {owners_gap(d, 'swarm', 'alone', 'greedy')}); its own family {owners_gap(d, 'swarm', 'alone', endpoint='own')}"),
        (OWNERS, lambda d: f"at 4 groups a round {owners_gap(d, 'swarm', 'union')} (greedy {owners_gap(d, 'swarm', 'union', 'greedy')}), "
                           f"at {owners_fewer(d, 'swarm', 'union')} fewer generated tokens"),
        (OWNERS, lambda d: f"at 2 groups a round ({owners_fewer(d, 'union_tokens', 'swarm')} fewer tokens than the swarm) "
                           f"{owners_gap(d, 'swarm', 'union_tokens')}")]),
    ("SmolLM2-135M silo, LoRA on an NF4 base vs full fine-tuning", [
        (NF4, lambda d: f"held-out {arm(d, 'smollm2-nf4 4/0')['eval_first']:.3f} -> {arm(d, 'smollm2-nf4 4/0')['eval_last']:.3f} vs "
                        f"{arm(d, 'smollm2 4/0')['eval_first']:.3f} -> {arm(d, 'smollm2 4/0')['eval_last']:.3f}"),
        (NF4, lambda d: f"cumulative reward {vs_silo(arm(d, 'smollm2-nf4 4/0'))}")]),
    ("free identities against the network", [
        (HOSTILE["relay-computable"], lambda b, a: f"relay slots to {b['runs'][0]['hostile']} strangers publishing computable "
                                                   f"groups {b['runs'][0]['strangers_granted']} -> {a['runs'][0]['strangers_granted']}"),
        (HOSTILE["relay-ids"], lambda b, a: f"4 peer ids on one address relay {relay_ids(b, 4):.3f} -> {relay_ids(a, 4):.3f} MiB/s"),
        (HOSTILE["level-computable"], level_grind),
        (HOSTILE["px-aim-redials"], redials)]),
    ("free answers against discovery", [
        (HOSTILE["dht-flood"], dht_meet),
        (HOSTILE["dht-flood"], dht_dials("flood")),
        (HOSTILE["dht-eclipse"], dht_dials("eclipse")),
        (HOSTILE["dialback-liar"], liar_believed),
        (HOSTILE["level-forward"], forwarded)]),
    (PARAGRAPH, [
        (EXP, lambda d: f"about a fifth ({pct(arm(d, 'homogeneous 4/4 signal')['vs_silo'])} at 4/4"),
        (GUARDED, lambda d: f"{pct(arm(d, 'homogeneous 4/4 guarded')['vs_silo'])} under `guarded`)"),
        (REAL, lambda d: f"({pct(arm(d, 'smollm2 2/2 signal')['vs_silo'])} and {pct(arm(d, 'smollm2 2/2 guarded')['vs_silo'])} on 2 cores"),
        (GPU, lambda d: f"{vs_silo(arm(d, 'smollm2 4/4 guarded'))} at the paper's 8 groups"),
        (SPEC, lambda d: f"gains {arm(d, SPEC_SWARM)['expected_vs_silo']['node0 rg/products']['gap']:+.3f} expected accuracy"),
        (SPEC, lambda d: f"({len(arm(d, SPEC_SWARM)['seeds'])} seeds; held out by seed")]),
]


def section() -> tuple[list[list[str]], str]:
    """The Results table's rows (cells: what, figure, data, write-up) and the paragraph after it, spaces collapsed."""
    text = (ROOT / "README.md").read_text()
    body = text.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    lines = body.splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert table[0] == "| what | figure | data | write-up |" and set(table[1]) <= set("|- "), table[:2]
    rows = [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in table[2:]]
    after = "\n".join(lines[lines.index(table[-1]) + 1:])
    return rows, " ".join(after.split())


def row_of(key: str) -> tuple[str, str]:
    """(the text the figures must appear in: the what and figure cells, or the paragraph; the data cell)."""
    rows, paragraph = section()
    if key == PARAGRAPH:
        assert paragraph.startswith(PARAGRAPH), paragraph[:200]
        return paragraph, ""
    (row,) = [r for r in rows if key in r[0]]
    assert len(row) == 4, row
    return f"{row[0]} | {row[1]} |", row[2]


def paths(source) -> tuple[str, ...]:
    return source if isinstance(source, tuple) else (source,)


def test_every_row_of_the_table_has_its_figures_checked_and_its_data_linked():
    rows, _ = section()
    keys = [key for key, _ in RESULTS]
    unchecked = [r[0] for r in rows if sum(key in r[0] for key in keys) != 1]
    assert unchecked == [], "Results rows without exactly one entry in tests/test_results.py RESULTS"
    stale = [key for key in keys if key != PARAGRAPH and not any(key in r[0] for r in rows)]
    assert stale == [], "RESULTS entries for rows the README no longer has"
    missing = [(r[0][:60], link) for r in rows for link in re.findall(r"\]\(([^)\s]+)\)", r[2])
               if not link.startswith("docs/bench/") or not (ROOT / link).exists()]
    assert missing == [], "data links that lead to no file under docs/bench"
    bare = [r[0][:60] for r in rows if not re.search(r"\]\(docs/bench/[^)\s]+(\.json|/)\)", r[2])]
    assert bare == [], "rows whose data column links no JSON file or folder"


@pytest.mark.parametrize("key, figures", RESULTS, ids=[key[:40] for key, _ in RESULTS])
def test_each_results_figure_is_what_its_file_holds(key, figures):
    text, data = row_of(key)
    wrong, expected = [], []
    for source, figure in figures:
        got = figure(*(load(p) for p in paths(source)))
        expected.append(got)
        if got not in text:
            wrong.append(f"README Results row {key!r}: expected {got!r}, from docs/bench/{' + '.join(paths(source))}")
        if key != PARAGRAPH:
            links = re.findall(r"\]\(docs/bench/([^)\s]+)\)", data)
            unlinked = [p for p in paths(source) if not any(p == link or link.endswith("/") and p.startswith(link) for link in links)]
            if unlinked:
                wrong.append(f"README Results row {key!r}: its data column does not link {unlinked}")
    # every decimal the row states is one of the figures read above: a figure with no file fails here
    unsourced = [n for n in re.findall(r"[+-]?\d+\.\d+", text) if not any(n in e for e in expected)]
    if unsourced:
        wrong.append(f"README Results row {key!r}: {unsourced} read from no file (add them to RESULTS, or take them out)")
    assert not wrong, "\n".join(wrong)
