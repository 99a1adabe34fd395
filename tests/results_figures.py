"""What the docs' result claims are checked against: every number a README Results row or a docs/bench page's "What
we know" bullet prints, recomputed from the raw files under docs/bench that the row or bullet links.

A claim's text is read as a sequence of number tokens (`numbers`) and must equal, token for token and in order, the
sequence its function in CLAIMS computes, each figure formatted at the precision the doc prints it: an edited digit,
a dropped decimal ("+0.06" for "+0.060") or two swapped figures fail, where a prefix or an anywhere-in-the-row match
would pass. Grids are recomputed from their per-run result.json files with the report's own code
(`experiment.paired.summarize`, `owners.comparisons`), not read from the merged results.json, so a merged file edited
by hand cannot carry a wrong figure into a doc either. A function reads files only through `load`, `grid` and
`seed_runs`, which record what it read: tests/test_results.py holds every file read to one the claim links."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from experiment.paired import ci95, held_out_vs_silo, mde, summarize

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"

# Text that holds digits but states no result, dropped before numbers are read: code spans (commands and flags, whose
# values the JSON's command holds), link targets and file-name link texts, names with a number in them (Gemma 3, the
# Zen 4 CPU), a commit's hash, the intervals' 95% level (the method, fixed in experiment.paired), the machine's cores
# (the hardware a run was given, recorded in its JSON's `cpus` but chosen, not measured), a run's date, and the
# published figures a result is set beside, each with its source in the text: the SAPO paper's gain and the field's
# hole-punching rate (the DCUtR measurement in the IPFS network, arXiv 2510.27500).
NOT_FIGURES = re.compile(r"`[^`]*`|\]\([^)]*\)|\[[^\]]*(?:\.json|/)\]|\bGemma 3\b|\bZen 4\b"
                         r"|\b[Tt]he paper's \+94%|\bthe field's 70% (?:±|\+-) 7\.1%"
                         r"|\b(?=[0-9a-f]*[a-f])[0-9a-f]*\d[0-9a-f]*\b(?<=\w{7})|\b95% intervals?\b"
                         r"|\b\d+ (?:CPU |idle )?cores\b|\b\d+-core\b|\b\d{4}-\d\d-\d\d\b")
# A number token: a split such as 4/4; or a signed or plain number (thousands with commas, decimals, 1e-5) with its
# unit when glued (%, x); one glued to letters (135M, H100, 2cpu, p95) is part of a name, not a figure.
NUMBER = re.compile(r"\d+/\d+(?![\w/])|(?:(?<![\w.])[+-]|(?<![\w.+-]))(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e-?\d+)?"
                    r"(?:%|x(?!\w))?(?!\w)")


def numbers(text: str) -> list[str]:
    """The number tokens of a text in order; a range "3.8-7.1%" reads as its two ends."""
    text = re.sub(r"(?<=\d)-(?=[+-]?\d)", " to ", NOT_FIGURES.sub(" ", text))
    return NUMBER.findall(text)


# --- reading, with a record of what was read ---------------------------------------------------------------------

READ: list[str] = []  # paths under docs/bench read since the last `reading()` began


@contextmanager
def reading():
    """Collects the paths (files, or grid folders) a claim's function reads."""
    READ.clear()
    yield READ


@cache
def _json(path: str) -> dict:
    return json.loads((BENCH / path).read_text())


def load(path: str) -> dict:
    READ.append(path)
    return _json(path)


@cache
def _seed_runs(folder: str) -> tuple[dict, ...]:
    return tuple(_json(str(p.relative_to(BENCH))) for p in sorted((BENCH / folder).glob("*/seed*/result.json")))


def seed_runs(source: str) -> list[dict]:
    """Every run of a grid: a folder's per-run result.json files, or the runs a single experiment file holds."""
    READ.append(source)
    return list(_seed_runs(source)) if (BENCH / source).is_dir() else _json(source)["runs"]


@cache
def _grid(source: str) -> dict[str, dict]:
    return {row["config"]: row for row in summarize(seed_runs(source))}


def grid(source: str) -> dict[str, dict]:
    """Each configuration's row (vs_silo, eval_last, expected gaps, ...) as the report computes it from the runs."""
    READ.append(source)
    return _grid(source)


def runs(source: str, config: str) -> dict[int, dict]:
    return {r["seed"]: r for r in seed_runs(source) if r["config"] == config}


def node(run: dict, name: str) -> dict:
    (n,) = [n for n in run["nodes"] if name in (n["name"], n["model"])]
    return n


def the(values) -> object:
    """The one value all of `values` share: a figure the doc states once for several runs must hold for each."""
    distinct = set(values)
    assert len(distinct) == 1, f"runs differ where the doc states one figure: {sorted(distinct, key=str)}"
    return distinct.pop()


def mean(xs) -> float:
    return statistics.mean(list(xs))


# --- formatting as the docs print --------------------------------------------------------------------------------

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
    return gap(mean(xs), ci95(xs))


def spread(xs, fmt: str) -> str:
    return f"{fmt.format(min(xs))} to {fmt.format(max(xs))}"


def split(run: dict) -> str:
    return f"{run['local']}/{run['external']}"


def rate(x: float) -> str:
    """A learning rate as the docs print it: 1e-4, 6.7e-6."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def shape(source: str, config: str) -> dict:
    """What every seed of a configuration shares: nodes, groups a round, rounds; and how many seeds ran."""
    rs = list(runs(source, config).values())
    return {**{k: the(r[k] for r in rs) for k in ("nodes_n", "local", "external", "rounds", "overdraw")}, "seeds": len(rs)}


@dataclass(frozen=True)
class Claim:
    """A README Results row (by text in its "what" cell) or a "What we know" bullet (by its opening words) of `doc`,
    and the figures it states, in the order it states them."""
    doc: str
    key: str
    figures: Callable[[], list]


# --- the files -----------------------------------------------------------------------------------------------------

EXP, GUARDED, TRIED = "sapo-experiment-2cpu.json", "sapo-experiment-guarded-2cpu.json", "sapo-experiment-guarded-tried-2cpu.json"
HETERO, GEMMA, REAL, GPU = "hetero-2cpu", "gemma-smollm2-2cpu", "real-grid-2cpu", "gpu-grid-h100"
STEP, SPEC, NF4, OWNERS = "step-size-40-2cpu", "specialists-2cpu", "nf4-check-2cpu", "owners-2cpu"
DOCTOR_PAIRS = tuple(f"decode-step-doctor-ab-2cpu/{k}-{which}.json" for k in (1, 2, 3) for which in ("current", "at-1e47067"))
DOCTOR_2CPU, DOCTOR_H200 = "doctor-bench-smollm2-135m-2cpu.json", "doctor-bench-h200/recipe.json"
STEPS = tuple(f"round-smollm2-135m-own-prompts-{run}-2cpu.json" for run in ("mb8", "lora-mb8", "nf4-mb8"))
GEMMA_STEP = "round-gemma3-270m-own-prompts-mb8-2cpu.json"
CONTENTION = ("contention-smollm2-135m-2cpu.json", "contention-repeat-smollm2-135m-2cpu.json")
ONE_THREAD = "contention-one-thread-smollm2-135m-2cpu.json"


def hostile(case: str) -> tuple[dict, dict]:
    return load(f"hostile-{case}-before-2cpu.json"), load(f"hostile-{case}-after-2cpu.json")


# --- figures that take more than a line ----------------------------------------------------------------------------

HETERO_ARMS = ("demo 4/4 signal", "demo 4/4 guarded", "demo 4/4 scoped", "demo 4/4 guarded peer_tasks")
GEMMA_SWARMS = [f"gemma+smollm2 2/2 {rule} [{model}]" for rule in ("guarded", "scoped") for model in ("gemma3-270m", "smollm2-135m")]
SPEC_SWARM, SPEC_ALONE, SPEC_UNION = "specialists 2/2 guarded", "specialists 4/0", "specialists-union 4/0"


def per_seed(source: str, config: str, other: str, name: str, key: str, dataset: str) -> list[float]:
    """Node `name`'s last `key` accuracy on `dataset` in `config` minus the same node's in `other`, seed by seed."""
    ours, theirs = runs(source, config), runs(source, other)
    return [node(ours[s], name)[f"{key}_by_dataset_last"][dataset] - node(theirs[s], name)[f"{key}_by_dataset_last"][dataset]
            for s in sorted(ours) if s in theirs]


def tiny_sharing() -> list:
    s, g = shape(EXP, "homogeneous 4/4 signal"), grid(EXP)
    return [s["nodes_n"], s["local"], s["external"], shape(EXP, "homogeneous 8/0")["local"], s["rounds"], s["seeds"],
            vs_silo(g["homogeneous 4/4 signal"])]


def tiny_six() -> list:
    s = shape(EXP, "homogeneous 2/6 signal")
    return [s["local"], s["external"], vs_silo(grid(EXP)["homogeneous 2/6 signal"])]


def tiny_controls() -> list:
    """The over-drawing silo draws local x overdraw tasks and keeps its local count."""
    s, g = shape(EXP, "homogeneous 8/0 overdraw 2"), grid(EXP)
    return [f"{s['local'] * s['overdraw']:.0f}", s["local"], vs_silo(g["homogeneous 8/0 overdraw 2"]),
            vs_silo(g["homogeneous control 4+4 own"])]


def tiny_guarded() -> list:
    s, g = shape(GUARDED, "homogeneous 4/4 guarded"), grid(GUARDED)
    return [split(s), s["seeds"], vs_silo(g["homogeneous 4/4 guarded"]),
            f"{g['homogeneous 4/4 guarded']['eval_last']:.3f}", f"{g['homogeneous 4/4 signal']['eval_last']:.3f}",
            vs_silo(grid(TRIED)["homogeneous 4/4 guarded"])]


def hetero_figures() -> list:
    """The four rules' reward against the silo, tiny-b's held-out gap, and the effects the seeds could detect."""
    g = grid(HETERO)
    others = [g[a]["vs_default"]["reward"]["mde"] for a in HETERO_ARMS if a != "demo 4/4 guarded"]
    return [spread([100 * g[a]["vs_silo"] for a in HETERO_ARMS], "{:+.1f}%"),
            spread([g[f"{a} [tiny-b]"]["eval_last_vs_silo"] for a in HETERO_ARMS], "{:+.2f}"),
            f"{100 * min(others):.1f} to {100 * max(others):.1f}%"]


def hetero_shape() -> list:
    s = shape(HETERO, "demo 4/4 signal")
    return [split(s), s["seeds"], s["rounds"]]


def gemma_figures(up: bool) -> list:
    """Both models against their silos, Gemma's `arith` under each rule (and, with `up`, how many seeds it rose in),
    `scoped` against `guarded`."""
    g = grid(GEMMA)
    arith = lambda rule: stats(g[f"gemma+smollm2 2/2 {rule} [gemma3-270m]"]["expected_vs_silo"]["node0 arith"])  # noqa: E731
    ups = [per_seed(GEMMA, f"gemma+smollm2 2/2 {rule}", "gemma+smollm2 4/0", "gemma3-270m", "expected", "arith")
           for rule in ("scoped", "guarded")]
    rose = [the(map(len, ups)) if all(x > 0 for u in ups for x in u) else "not every seed", sum(map(len, ups)),
            len(runs(GEMMA, "gemma+smollm2 4/0"))]
    return [spread([g[a]["expected_vs_silo"]["all"]["gap"] for a in GEMMA_SWARMS], "{:+.3f}"), arith("scoped"),
            arith("guarded"), *(rose if up else []), stats(g["gemma+smollm2 2/2 scoped"]["vs_default"]["held_out"])]


def gemma_shape() -> list:
    s = shape(GEMMA, "gemma+smollm2 2/2 guarded")
    return [split(s), s["rounds"], s["seeds"]]


def gemma_pair() -> list:
    """Groups a round, local and external, then seeds: "2 + 2, 4 seeds"."""
    s = shape(GEMMA, "gemma+smollm2 2/2 guarded")
    return [s["local"], s["external"], s["seeds"]]


def real_pair() -> list:
    s, g = shape(REAL, "smollm2 2/2 signal"), grid(REAL)
    return [split(s), split(runs(REAL, "smollm2 4/0")[0]), s["rounds"], s["seeds"],
            vs_silo(g["smollm2 2/2 signal"]), vs_silo(g["smollm2 2/2 guarded"]),
            held(g["smollm2 2/2 signal"]), held(g["smollm2 2/2 guarded"])]


def weaker_peer() -> list:
    s, g = shape(REAL, "smollm2+tiny 2/2 signal"), grid(REAL)
    return [split(s), s["rounds"], s["seeds"], vs_silo(g["smollm2+tiny 2/2 signal"]),
            held(g["smollm2+tiny 2/2 signal"]), pct(g["smollm2+tiny 2/2 guarded"]["vs_silo"])]


def gpu_pair() -> list:
    s, g = shape(GPU, "smollm2 4/4 guarded"), grid(GPU)
    return [split(s), split(runs(GPU, "smollm2 8/0")[0]), s["rounds"], s["seeds"],
            vs_silo(g["smollm2 4/4 guarded"]), held(g["smollm2 4/4 guarded"]), pct(g["smollm2+tiny 4/4 guarded"]["vs_silo"])]


def backend(d: dict) -> dict:
    """A `sapo doctor --bench` JSON's transformers backend."""
    (b,) = [b for b in d["backends"] if b["backend"] == "transformers"]
    return b


def rpm(d: dict) -> float:
    return backend(d)["rounds_per_minute"]


def doctor_round() -> list:
    """The recipe's round shape, three pairs taking turns (the current code, then 1e47067's float32 sampler), the
    float32 sampler's own bench, and the H200's."""
    ds = [load(p) for p in DOCTOR_PAIRS]
    now, then = ds[0::2], ds[1::2]
    return [f"{the(backend(d)['groups_per_round'] for d in ds):.0f}", the(backend(d)["completions_per_group"] for d in ds),
            " / ".join(f"{rpm(d):.2f}" for d in now), " / ".join(f"{rpm(a) / rpm(c):.2f}x" for a, c in zip(now, then)),
            f"{rpm(load(DOCTOR_2CPU)):.2f}", f"{rpm(load(DOCTOR_H200)):.1f}"]


def busy_shares(d: dict, code: str) -> list[float]:
    """Each repeat's rounds a minute beside the busy loops over the same repeat's idle ones, for one checkout."""
    pace = {(r["repeat"], r["busy"]): r["rounds_per_minute"] for r in d["runs"] if r["code"] == code}
    return [pace[rep, busy] / pace[rep, 0] for rep, busy in pace if busy]


def idle_rpm(d: dict) -> float:
    return mean(r["rounds_per_minute"] for r in d["runs"] if r["busy"] == 0)


def contention(percent: bool) -> list:
    """The pairs of the code that follows free cores (the first run's, beside the code before, and the repeat's), the
    code before's, and a one-thread node's ceiling: two thirds of a core's pace, over the two-thread node's idle."""
    first, repeat, one = (load(p) for p in (*CONTENTION, ONE_THREAD))
    before, after = first["command"][first["command"].index("--code") + 1:][:2]
    now = busy_shares(first, after)
    shares = now + busy_shares(repeat, repeat["runs"][0]["code"])
    fmt = (lambda x: f"{100 * x:.0f}%") if percent else (lambda x: f"{x:.2f}")  # noqa: E731
    ceiling = fmt(2 / 3 * idle_rpm(one) / idle_rpm(repeat))
    if percent:
        return [fmt(mean(shares)), fmt(ci95(shares)), len(shares), fmt(mean(busy_shares(first, before))), ceiling]
    return [fmt(mean(shares)), fmt(ci95(shares)), len(shares), fmt(mean(now)), fmt(mean(busy_shares(first, before))), ceiling]


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


def steps(interleaved: bool) -> list:
    """The micro-batch, then each step's measured peak and the planner's estimate: all peaks then all estimates (the
    README), or peak and estimate side by side (memory.md)."""
    ds = [load(p) for p in (*STEPS, GEMMA_STEP)]
    shape_ = [the(d["rows"][0]["micro_batch"] for d in ds if d["rows"][0]["own_prompts"])]
    peaks, estimates = [f"{d['rows'][0]['peak_rss_gb']:.2f}" for d in ds], [f"{step_estimate(d):.2f}" for d in ds]
    return shape_ + ([x for pair in zip(peaks, estimates) for x in pair] if interleaved else peaks + estimates)


def step_size() -> list:
    """Gemma from a plain folder with the controller, and at its size's fixed rate; SmolLM2 from a destructive rate
    (each seed's end), and at its recipe against the fixed rate."""
    g = grid(STEP)
    gemma, fixed, high = g["gemma-adapt 4/0"], g["gemma-fixed 4/0 lr 6.7e-06"], g["smollm2-adapt 4/0 lr 0.0001"]
    s = shape(STEP, "gemma-adapt 4/0")
    finals = [n["eval_last"] for r in runs(STEP, high["config"]).values() for n in r["nodes"]]
    return [s["rounds"], s["seeds"], f"{gemma['eval_first']:.3f}", f"{gemma['eval_last']:.3f}", f"{fixed['eval_last']:.3f}",
            rate(the(r["lr"] for r in runs(STEP, high["config"]).values())), f"{high['eval_first']:.3f}",
            f"{high['eval_last']:.3f}", spread(finals, "{:.3f}"), held(g["smollm2-adapt 4/0"])]


WRONG = "step-size-80-2cpu"
GEMMA_WRONG, GEMMA_WRONG_FIXED = "gemma-adapt 4/0 lr 6.7e-06", "gemma-fixed 4/0 lr 6.7e-06"
GEMMA_WRONG_LOW, SMOLLM2_WRONG = "gemma-adapt 4/0 lr 6.7e-06 kl 0.001", "smollm2-adapt 4/0 lr 0.001"


def wrong_rate() -> tuple[dict[str, dict], dict[tuple[str, str], dict]]:
    """The wrong-rate grid's arms and pairs as scripts/bench/step_size_report.py computes them, from the per-run files."""
    from step_size_report import arm_rows, arms_of, pair_rows

    arms = arms_of(seed_runs(WRONG))
    return {r["arm"]: r for r in arm_rows(arms)}, {(p["arm"], p["against"]): p for p in pair_rows(arms)}


def held_at(arm: dict, k: int) -> str:
    return f"{dict(arm['eval'])[k]:.3f}"


def early_steps(arm: dict) -> tuple[int, float, list[float]]:
    """How many steps each seed took at its first rate (one count for all), that rate, and every rate after them."""
    curves = [[lr for lr in c if lr is not None] for c in arm["rate_curves"].values()]
    counts = [next(i for i, lr in enumerate(c) if lr != c[0]) for c in curves]
    return the(counts), the(c[0] for c in curves), [lr for c, n in zip(curves, counts) for lr in c[n:]]


def wrong_rate_figures() -> dict[str, object]:
    """Every figure the docs state of the wrong-rate grid, by name: its shape; Gemma from its size's rate fixed, with
    the controller (against the fixed rate, its round 80 against its round 20, where its rate ended) and at a lower
    target (the same, and against the default target); SmolLM2 from 1e-3: its first steps, the damage, where it ended."""
    arms, pairs = wrong_rate()
    gemma, fixed, low, smol = (arms[a] for a in (GEMMA_WRONG, GEMMA_WRONG_FIXED, GEMMA_WRONG_LOW, SMOLLM2_WRONG))
    early, last = gemma["kept_from"], gemma["eval"][-1][0]
    shapes = [shape(WRONG, arm) for arm in (GEMMA_WRONG, GEMMA_WRONG_FIXED, GEMMA_WRONG_LOW, SMOLLM2_WRONG)]
    config = {arm: the((r["lr"], r.get("target_kl")) for r in seed_runs(WRONG) if r["config"] == arm) for arm in arms}
    vs_fixed, vs_default = (dict(pairs[arm, against]["gaps"])[last]
                            for arm, against in ((GEMMA_WRONG, GEMMA_WRONG_FIXED), (GEMMA_WRONG_LOW, GEMMA_WRONG)))
    n, first, after = early_steps(smol)
    ended, low_ended = ([p["last"] for p in arm["rates"].values()] for arm in (gemma, low))
    return {"rounds": the(s["rounds"] for s in shapes), "seeds": the(s["seeds"] for s in shapes), "early": early,
            "last": last, "gemma lr": rate(config[GEMMA_WRONG][0]), "fixed 0": held_at(fixed, 0),
            "fixed last": held_at(fixed, last), "gemma 0": held_at(gemma, 0), "gemma early": held_at(gemma, early),
            "gemma last": held_at(gemma, last), "vs fixed": stats(vs_fixed), "ended": rate(min(ended)),
            "ended to": rate(max(ended)), "kept": stats(gemma["kept"]), "kept mde": f"{gemma['kept']['mde']:.3f}",
            "low target": config[GEMMA_WRONG_LOW][1], "low kept": stats(low["kept"]), "low last": held_at(low, last),
            "low ended": rate(min(low_ended)), "low ended to": rate(max(low_ended)), "vs default": stats(vs_default),
            "vs default mde": f"{vs_default['mde']:.3f}", "smollm2 lr": rate(config[SMOLLM2_WRONG][0]),
            "smollm2 early steps": n, "smollm2 first": rate(first), "smollm2 0": held_at(smol, 0),
            "smollm2 early": held_at(smol, early), "smollm2 after": rate(min(after)),
            "smollm2 after to": rate(max(after)), "smollm2 last": held_at(smol, last)}


def wrong_rate_said(*names: str) -> list:
    figures = wrong_rate_figures()
    return [figures[name] for name in names]


def specialists() -> list:
    g, s = grid(SPEC), shape(SPEC, SPEC_SWARM)
    a = g[SPEC_SWARM]["expected_vs_silo"]
    swarm, alone = runs(SPEC, SPEC_SWARM).values(), runs(SPEC, SPEC_ALONE).values()
    last = [mean(node(r, "node0")["expected_by_dataset_last"]["rg/products"] for r in rs) for rs in (swarm, alone)]
    both = [*swarm, *alone]
    own = [a[f"node0 {family}"] for family in ("arith", "rg/basic_arithmetic")]
    union = per_seed(SPEC, SPEC_SWARM, SPEC_UNION, "node0", "expected", "rg/products")
    return [split(s), s["rounds"], s["seeds"], stats(a["node0 rg/products"]),
            f"{last[0]:.2f}", f"{last[1]:.2f}", the(r["rounds"] for r in both),
            f"{the(node(r, 'node0')['expected_by_dataset_first']['rg/products'] for r in both):.3f}",
            the(node(r, "node0")["curves"]["eval"][0][0] for r in both),
            gaps(per_seed(SPEC, SPEC_SWARM, SPEC_ALONE, "node0", "eval", "rg/products")), stats(a["node1 arith"]),
            gaps(per_seed(SPEC, SPEC_SWARM, SPEC_ALONE, "node1", "eval", "arith")),
            " / ".join(f"{o['gap']:+.3f}" for o in own), " / ".join(f"{o['gap'] - o['ci95']:+.3f}" for o in own),
            gaps(union), f"{mde(union):.2f}", fewer(g[SPEC_SWARM]["tokens_per_node"], g[SPEC_UNION]["tokens_per_node"])]


def fewer(mine: float, other: float) -> str:
    return f"{100 * (1 - mine / other):.0f}%"


@cache
def _owners() -> list[dict]:
    from owners import ARMS, comparisons

    by_arm = {arm: {r["seed"]: r for r in _seed_runs(OWNERS) if r["config"] == name} for arm, name in ARMS.items()}
    return comparisons(by_arm)


def owners_row(arm: str, against: str, measure: str = "expected", endpoint: str = "taught") -> dict:
    READ.append(OWNERS)
    (row,) = [r for r in _owners() if (r["arm"], r["against"], r["measure"], r["endpoint"]) == (arm, against, measure, endpoint)]
    return row


def owners_gap(*which: str, **named: str) -> str:
    """A gap and its interval; where the interval holds zero, the smallest effect the seeds could detect too."""
    r = owners_row(*which, **named)
    return stats(r) + ("" if abs(r["gap"]) > r["ci95"] else f" {r['mde']:.3f}")


def owners_fewer(arm: str, than: str) -> str:
    """How many fewer tokens a node of `arm` generated than one of `than`, over the seeds they pair on."""
    (row,) = [r for r in _owners() if (r["measure"], r["endpoint"]) == ("expected", "taught") and {r["arm"], r["against"]} == {arm, than}]
    mine, other = (row["tokens_per_node"]["ours"], row["tokens_per_node"]["theirs"])[::1 if row["arm"] == arm else -1]
    return fewer(mine, other)


def owners_families() -> list:
    """The products family's largest second factor and the three-to-four-term sums, as the runs' task mixes say."""
    mixes = [json.loads(m)[0] for m in the(tuple(r["task_mixes"]) for r in runs(OWNERS, "owners 2/2 guarded").values())]
    (products,) = [m["config"] for m in mixes if m["name"] == "arith"]
    (sums,) = [m["config"] for m in mixes if m["name"] == "rg/basic_arithmetic"]
    return [products["max_second"], sums["min_terms"], sums["max_terms"]]


def owners(readme: bool) -> list:
    """The swarm against each owner alone (taught and own family), against the union silo at 4 groups a round and at
    2; with `readme`, also the families, the rounds and the seeds each comparison pairs on."""
    s = shape(OWNERS, "owners 2/2 guarded")
    seeds = lambda against: len(owners_row("swarm", against)["paired_seeds"])  # noqa: E731
    four, two = shape(OWNERS, "owners-union 4/0")["local"], shape(OWNERS, "owners-union 2/0")["local"]
    taught = [owners_gap("swarm", "alone"), owners_gap("swarm", "alone", "greedy"), owners_gap("swarm", "alone", endpoint="own")]
    versus = [owners_gap("swarm", "union"), owners_gap("swarm", "union", "greedy"), owners_fewer("swarm", "union")]
    at_two = [two, owners_fewer("union_tokens", "swarm"), owners_gap("swarm", "union_tokens")]
    if not readme:
        return [seeds("alone"), s["rounds"], *taught, *versus, *at_two]
    return [*owners_families(), split(s), s["rounds"], seeds("alone"), seeds("union_tokens"), two, seeds("union"), four,
            owners_fewer("swarm", "union"), *taught, four, *versus, *at_two]


def nf4() -> list:
    g, s = grid(NF4), shape(NF4, "smollm2-nf4 4/0")
    q, full = g["smollm2-nf4 4/0"], g["smollm2 4/0"]
    return [s["rounds"], s["seeds"], *(f"{c[k]:.3f}" for c in (q, full) for k in ("eval_first", "eval_last")), vs_silo(q)]


def relay_ids(d: dict) -> tuple[int, float]:
    """The most ids the run put on one address, and what they got relayed under attack."""
    run = max(d["runs"], key=lambda r: r["hostile"])
    return run["hostile"], run["phases"]["attack"]["relayed_mib_per_s"]


def level_grind(before: dict, after: dict) -> list:
    """The shard level strangers ground a node into, before the rule and after, and in how many seeds."""
    reached = max(s["deepest_level_attack"] for s in before["summary"])
    stayed = max(s[f"deepest_level_{phase}"] for s in after["summary"] for phase in ("before", "attack", "after"))
    seeds = sum(b["deepest_level_attack"] == reached and max(a["deepest_level_attack"], a["deepest_level_after"]) == stayed
                for b, a in zip(before["summary"], after["summary"]))
    return [the(s["hostile"] for s in before["summary"] + after["summary"]), reached, stayed, seeds, len(after["summary"])]


def free_identities() -> list:
    (rb, ra), (ib, ia) = hostile("relay-computable"), hostile("relay-ids")
    level = level_grind(*hostile("level-computable"))
    (pb,), (pa,) = (d["summary"] for d in hostile("px-aim-redials"))
    (ids, before), (_, after) = relay_ids(ib), relay_ids(ia)
    return [level[4], rb["runs"][0]["hostile"], rb["runs"][0]["strangers_granted"], ra["runs"][0]["strangers_granted"],
            ids, f"{before:.3f}", f"{after:.3f}", *level, f"{the(s['after_s'] / 60 for s in (pb, pa)):.0f}",
            pb["attempts_at_hinted_host_after"], pa["attempts_at_hinted_host_after"]]


def discovery() -> list:
    """Meeting time and dials to made-up hosts beside hostile DHT servers, the dial-back liar, forwarded ground ids."""
    (fb,), (fa,) = (d["runs"] for d in hostile("dht-flood"))
    (eb,), (ea,) = (d["runs"] for d in hostile("dht-eclipse"))
    lb, la = ([r for r in d["runs"] if r["lie"] == "reached"][0] for d in hostile("dialback-liar"))
    (gb,), (ga,) = (d["summary"] for d in hostile("level-forward"))
    met = lambda r: [] if r["met_s"] is None else [f"{r['met_s']:.1f}"]  # noqa: E731
    most = lambda r: max(r["connections_by_node"].values())  # noqa: E731
    window = lambda pair: f"{the(r['window_s'] / 60 for r in pair):.0f}"  # noqa: E731
    return [*met(fb), *met(fa), window((fb, fa)), most(fb), most(fa), window((eb, ea)), most(eb), most(ea),
            lb["believed_public_s"], la["believed_public_s"], f"{the(r['window_s'] for r in (lb, la)):.0f}",
            gb["deepest_level_attack"], ga["deepest_level_attack"]]


def punch_row() -> list:
    """The README's row: the path, then each router kind's direct connections over its attempts."""
    runs_ = load("punch-2cpu.json")["runs"]
    kinds = [[r for r in runs_ if r["case"] == kind] for kind in ("masquerade", "eim", "symmetric")]
    return [f"{the(r['rtt_ms'] for r in runs_):.0f}", f"{100 * the(r['loss'] for r in runs_):.0f}%",
            *(x for rs in kinds for x in (sum(r["ok"] for r in rs), len(rs)))]


def paragraph() -> list:
    """The paragraph after the table: the tiny testbed, the SmolLM2 pairs and the specialists, as their rows say."""
    real, gpu, spec = grid(REAL), grid(GPU), grid(SPEC)
    s, gs = shape(REAL, "smollm2 2/2 signal"), shape(GPU, "smollm2 4/4 guarded")
    return [pct(grid(EXP)["homogeneous 4/4 signal"]["vs_silo"]), split(runs(EXP, "homogeneous 4/4 signal")[0]),
            pct(grid(GUARDED)["homogeneous 4/4 guarded"]["vs_silo"]), pct(real["smollm2 2/2 signal"]["vs_silo"]),
            pct(real["smollm2 2/2 guarded"]["vs_silo"]), s["rounds"], vs_silo(gpu["smollm2 4/4 guarded"]),
            gs["local"] + gs["external"], gs["rounds"], f"{spec[SPEC_SWARM]['expected_vs_silo']['node0 rg/products']['gap']:+.3f}",
            shape(SPEC, SPEC_SWARM)["seeds"]]


# --- the claims, in the order the docs state them ------------------------------------------------------------------

README = "README.md"
PARAGRAPH = "The paper's +94% is not reached"  # the paragraph after the Results table, checked as a row

CLAIMS = [
    Claim(README, "4 tiny nodes, 4 local + 4 external groups under `signal`", tiny_sharing),
    Claim(README, "the same, 2 local + 6 external", tiny_six),
    Claim(README, "controls: the silo drawing 16 tasks", tiny_controls),
    Claim(README, "mixed tiny models (two architectures and tokenizers)",
          lambda: [split(runs(EXP, "heterogeneous 4/4 signal")[0]), vs_silo(grid(EXP)["heterogeneous 4/4 signal"])]),
    Claim(README, "the `guarded` sampling rule (the default)", tiny_guarded),
    Claim(README, "the demo's mixed tiny swarm (tiny-a, tiny-b, tiny-a)", lambda: hetero_shape() + hetero_figures()),
    Claim(README, "Gemma 3 270M beside SmolLM2-135M", lambda: gemma_shape() + gemma_figures(up=True)),
    Claim(README, "two SmolLM2-135M nodes, 2/2 vs 4/0", real_pair),
    Claim(README, "SmolLM2-135M beside a tiny node, 2/2", weaker_peer),
    Claim(README, "two SmolLM2-135M nodes, 4/4 vs 8/0 under `guarded`, on one H100", gpu_pair),
    Claim(README, "SmolLM2-135M round as a node runs it", doctor_round),
    Claim(README, "SmolLM2-135M's recipe round beside two busy loops", lambda: contention(percent=False)),
    Claim(README, "training step at micro-batch 8, every row its own prompt", lambda: steps(interleaved=False)),
    Claim(README, "the step-size controller from a wrong rate", lambda: wrong_rate_said(
        "rounds", "seeds", "gemma lr", "fixed 0", "fixed last", "gemma 0", "gemma early", "early", "gemma last", "last",
        "vs fixed", "ended", "ended to", "last", "early", "kept", "kept mde", "low target", "early", "low kept",
        "low last", "last", "low ended", "low ended to", "vs default", "vs default mde", "smollm2 lr",
        "smollm2 early steps", "smollm2 first", "smollm2 0", "smollm2 early", "early", "smollm2 after",
        "smollm2 after to", "smollm2 last", "last")),
    Claim(README, "the step-size controller from each model's recipe rate", step_size),
    Claim(README, "two SmolLM2-135M specialists", specialists),
    Claim(README, "four SmolLM2-135M owners", lambda: owners(readme=True)),
    Claim(README, "SmolLM2-135M silo, LoRA on an NF4 base", nf4),
    Claim(README, "free identities against the network", free_identities),
    Claim(README, "free answers against discovery", discovery),
    Claim(README, "home nodes behind NAT with no dialable member", punch_row),
    Claim(README, PARAGRAPH, paragraph),
]


# --- docs/bench/learning.md ----------------------------------------------------------------------------------------

def tiny_testbed() -> list:
    s, g, o = shape(EXP, "homogeneous 4/4 signal"), grid(EXP), shape(EXP, "homogeneous 8/0 overdraw 2")
    six = shape(EXP, "homogeneous 2/6 signal")
    return [s["rounds"], s["seeds"], s["local"], s["external"], vs_silo(g["homogeneous 4/4 signal"]), six["local"],
            six["external"], vs_silo(g["homogeneous 2/6 signal"]), o["local"], vs_silo(g["homogeneous 8/0 overdraw 2"]),
            vs_silo(g["homogeneous control 4+4 own"]), vs_silo(grid(GUARDED)["homogeneous 4/4 guarded"]),
            shape(GUARDED, "homogeneous 4/4 guarded")["seeds"]]


def smollm2_pairs() -> list:
    s, gs, g = shape(REAL, "smollm2 2/2 signal"), shape(GPU, "smollm2 4/4 guarded"), grid(REAL)
    silo = runs(REAL, "smollm2 4/0")[0]
    return [s["local"], s["external"], silo["local"], silo["external"], s["seeds"], s["rounds"],
            vs_silo(g["smollm2 2/2 signal"]), vs_silo(g["smollm2 2/2 guarded"]), gs["local"] + gs["external"], gs["rounds"],
            vs_silo(grid(GPU)["smollm2 4/4 guarded"]), held(grid(GPU)["smollm2 4/4 guarded"])]


def diagnosed() -> list:
    """SmolLM2 beside tiny-a against alone, and the diagnosis: held-out after the diagnosis's rounds, with tiny-a's
    groups and alone."""
    g, d = grid(REAL), load("diagnose-smollm2-tiny-a-2cpu.json")
    last = {arm: points[-1] for arm, points in d["arms"].items()}
    return [vs_silo(g["smollm2+tiny 2/2 signal"]), held(g["smollm2+tiny 2/2 signal"]),
            pct(g["smollm2+tiny 2/2 guarded"]["vs_silo"]), f"{last['own 2 + tiny-a 2']['accuracy']:.2f}",
            f"{last['own 4']['accuracy']:.2f}", the(p["round"] for p in last.values())]


def specialists_short() -> list:
    g, s = grid(SPEC), shape(SPEC, SPEC_SWARM)
    a = g[SPEC_SWARM]["expected_vs_silo"]
    union = per_seed(SPEC, SPEC_SWARM, SPEC_UNION, "node0", "expected", "rg/products")
    return [s["seeds"], s["rounds"], stats(a["node0 rg/products"]), stats(a["node1 arith"]), f"{mde(union):.2f}",
            fewer(g[SPEC_SWARM]["tokens_per_node"], g[SPEC_UNION]["tokens_per_node"])]


def pass_row(d: dict, dataset: str, **config) -> dict:
    (row,) = [r for r in d["rows"] if r["dataset"] == dataset and all(r["config"].get(k) == v for k, v in config.items())]
    return row


def real_model_needs() -> list:
    """The answer tag closed without and with a worked example, the recipe mix's pass rates, the rate sweep, Gemma's
    rates, and the paper's families."""
    bare, shown = load("pass-rates-no-example-smollm2-135m-2cpu.json"), load("pass-rates-smollm2-135m-2cpu.json")
    closed = sum(r["closed"] * bare["tasks"] * bare["completions"] for r in bare["rows"])
    mix = [pass_row(shown, "rg/basic_arithmetic", max_terms=3), pass_row(shown, "rg/products"),
           pass_row(shown, "arith", max_operand=99)]
    sweep = {rate(the(r["lr"] for r in runs("lr-sweep-2cpu", c).values())): grid("lr-sweep-2cpu")[c]
             for c in ("smollm2-sweep 4/0 lr 1e-05", "smollm2-sweep 4/0 lr 3e-05", "smollm2-sweep 4/0 lr 0.0001")}
    fastest, slower, destroys = sweep
    slow = sweep[slower]["expected_vs_silo"]["all"]  # below the fastest stable rate, in expected accuracy
    gemma = sorted(load(f"gemma-lr-2cpu/{p.name}/config.json")["grpo"]["lr"] for p in sorted((BENCH / "gemma-lr-2cpu").iterdir()))
    paper = load("pass-rates-paper-smollm2-135m-2cpu.json")
    right = sum(r["pass_rate"] * paper["tasks"] * paper["completions"] for r in paper["rows"])
    return [f"{closed:.0f}", len(bare["rows"]) * bare["tasks"] * bare["completions"],
            *(f"{100 * r['closed']:.0f}%" for r in mix[:2]), *(f"{r['pass_rate']:.2f}" for r in mix),
            the(r["temperature"] for r in mix), the(r["top_p"] for r in mix), fastest, slower,
            f"{-slow['gap']:.3f} ± {slow['ci95']:.3f}", destroys,
            rate(gemma[0]), rate(gemma[-1]), f"{right:.0f}", len(paper["rows"]) * paper["tasks"] * paper["completions"]]


def seeds_first(figures: list) -> list:
    """A claim that says "3 seeds x 40 rounds" where its row says "40 rounds, 3 seeds"."""
    return [figures[1], figures[0], *figures[2:]]


def step_size_short() -> list:
    """The wrong-rate grid's figures, then the recipe grid's: Gemma's path, and SmolLM2's recipe against the fixed
    rate with the effect its seeds could have detected."""
    silo = runs(STEP, "smollm2-fixed 4/0")
    _, recipe = held_out_vs_silo(sorted(runs(STEP, "smollm2-adapt 4/0").values(), key=lambda r: r["seed"]), silo, None)
    figures = step_size()
    return [*wrong_rate_said("seeds", "rounds", "gemma lr", "fixed 0", "fixed last", "gemma 0", "gemma last", "vs fixed",
                             "ended", "ended to", "last", "early", "kept", "kept mde", "low target", "low last",
                             "vs default", "vs default mde", "smollm2 lr", "smollm2 early steps", "smollm2 first",
                             "smollm2 0", "smollm2 early", "early", "smollm2 last"),
            *seeds_first(figures[:2]), figures[2], figures[3], figures[9], f"{mde(recipe):.2f}"]


def minutes(seconds: float) -> str:
    return f"{int(round(seconds) // 60)} min {round(seconds) % 60} s"


def demo() -> list:
    d = load("demo-gc-freeze-2cpu.json")
    times = [r["seconds"] for r in d["runs"]]
    return [minutes(min(times)), minutes(max(times)), spread([100 * r["vs_baseline"] for r in d["runs"]], "{:+.1f}%")]


LEARNING = "docs/bench/learning.md"
CLAIMS += [
    Claim(LEARNING, "**Sharing pays on the tiny testbed.**", tiny_testbed),
    Claim(LEARNING, "**Mixed tiny models**", lambda: [*hetero_shape()[1:], *hetero_figures()]),
    Claim(LEARNING, "**Two SmolLM2-135M nodes gain reward", smollm2_pairs),
    Claim(LEARNING, "**A weaker peer hurts", diagnosed),
    Claim(LEARNING, "**A peer of another family", lambda: [*gemma_pair(), *gemma_figures(up=False)]),
    Claim(LEARNING, "**Specialists teach each other", specialists_short),
    Claim(LEARNING, "**Four owners teach each other", lambda: owners(readme=False)),
    Claim(LEARNING, "**What a real model needs.**", real_model_needs),
    Claim(LEARNING, "**The step-size controller", step_size_short),
    Claim(LEARNING, "**LoRA on an NF4 base learns", lambda: seeds_first(nf4())),
    Claim(LEARNING, "**The demo**", demo),
]


# --- docs/bench/memory.md ------------------------------------------------------------------------------------------

def chunked_head() -> list:
    """The step's added peak, whole LM head -> chunked, with and without gradient checkpointing, and the time it cost."""
    ckpt, plain = load("logprobs-smollm2-135m-ckpt-2cpu.json"), load("logprobs-smollm2-135m-2cpu.json")
    peaks = [f"{d['results'][k]['added_peak_gb']:.2f}" for d in (ckpt, plain) for k in ("whole", "chunked")]
    slower = [f"{100 * (d['results']['chunked']['seconds'] / d['results']['whole']['seconds'] - 1):+.0f}%" for d in (ckpt, plain)]
    return [the(d["rows"] for d in (ckpt, plain)), the(d["tokens"] for d in (ckpt, plain)), *peaks, *slower]


def swarm_memory() -> list:
    """The machine's memory, each run's share and the four nodes' plan (as the swarm printed them), the peaks."""
    d = load("swarm-memory-smollm2-135m-2cpu.json")
    said = [re.search(r"(\d+) nodes plan ([\d.]+) GB together; each may use ([\d.]+) GB", r["together"]).groups() for r in d["runs"]]
    peaks = [max(n["memory_peak_gb"]) for r in d["runs"] for n in r["nodes"].values()]
    codes = {n["exit_code"] for r in d["runs"] for side in (r["summary"]["per_node"], r["summary"]["baseline"]["per_node"]) for n in side}
    return [re.search(r"(\d+) GiB", d["machine"]).group(1), " / ".join(s[2] for s in said), the(s[1] for s in said),
            spread(peaks, "{:.2f}"), the(codes)]


def owners_peaks(dtype: str) -> tuple[list[float], list[float]]:
    """Every owners-grid node's peak and plan, for the runs that sampled in `dtype`."""
    timings = [n["timing"] for r in seed_runs(OWNERS) for n in r["nodes"] if n["timing"]["sampling_dtype"] == dtype]
    return [t["peak_gb"] for t in timings], [t["planned_peak_gb"] for t in timings]


def under_plan() -> list:
    """Doctor's rounds against their plans (2 cores, H200, Gemma then), Gemma's plan in its grid, and the owners grid's
    peaks against plans: with the bfloat16 copies, and in float32."""
    smol, h200, gemma = (backend(load(p)) for p in (DOCTOR_2CPU, DOCTOR_H200, "doctor-bench-gemma3-270m-2cpu.json"))
    gemma_plan = max(n["timing"]["planned_peak_gb"] for r in seed_runs(GEMMA) for n in r["nodes"] if n["model"] == "gemma3-270m")
    peaks, plans = owners_peaks("bfloat16")
    over = [peak / plan - 1 for peak, plan in zip(peaks, plans)]
    together = max(sum(n["timing"]["peak_gb"] for n in r["nodes"]) for r in seed_runs(OWNERS)
                   if r["nodes"][0]["timing"]["sampling_dtype"] == "bfloat16")
    f32_peaks, f32_plans = owners_peaks("float32")
    return [f"{smol['peak_gb']:.2f}", f"{smol['planned_peak_gb']:.2f}", f"{h200['peak_gb']:.2f}", f"{h200['planned_peak_gb']:.1f}",
            f"{gemma['peak_gb']:.2f}", f"{gemma['planned_peak_gb']:.2f}", f"{gemma_plan:.2f}", spread(peaks, "{:.2f}"),
            spread(plans, "{:.2f}"), f"{100 * min(over):.0f}% to {100 * max(over):.0f}%", f"{together:.1f}",
            spread(f32_peaks, "{:.2f}"), spread(f32_plans, "{:.2f}")]


MEMORY = "docs/bench/memory.md"
CLAIMS += [
    Claim(MEMORY, "**The planner's step estimate", lambda: steps(interleaved=True)),
    Claim(MEMORY, "**The chunked LM head**", chunked_head),
    Claim(MEMORY, "**Four SmolLM2-135M nodes fit one machine**", swarm_memory),
    Claim(MEMORY, "**A node's round stays under its plan**", under_plan),
]


# --- docs/bench/gpu.md ---------------------------------------------------------------------------------------------

H200 = {name: f"doctor-bench-h200/{name}.json" for name in ("recipe", "paper-round", "paper-round-8gb", "paper-round-t1",
                                                            "long-full", "long-8gb")}


def gpu_grid() -> list:
    """The pair at the paper's round against 8 + 0, beside tiny-a; each arm's mean round (its SmolLM2 nodes': tiny-a
    runs beside as a companion), every SmolLM2 node's peak and the plan they shared."""
    s, g, silo = shape(GPU, "smollm2 4/4 guarded"), grid(GPU), runs(GPU, "smollm2 8/0")[0]
    timings = [n["timing"] for r in seed_runs(GPU) for n in r["nodes"] if n["model"] == "smollm2-135m"]
    c = g["smollm2 4/4 guarded"]
    return [s["seeds"], s["local"], s["external"], vs_silo(c), silo["local"], silo["external"], held(c),
            pct(g["smollm2+tiny 4/4 guarded"]["vs_silo"]), spread([r["round_s"] for r in g.values()], "{:.1f}"),
            spread([t["peak_gb"] for t in timings], "{:.1f}"), f"{the(t['planned_peak_gb'] for t in timings):.1f}"]


def h200_round() -> list:
    recipe, paper = backend(load(H200["recipe"])), backend(load(H200["paper-round"]))
    long = [backend(load(H200[k]))["rounds_per_minute"] for k in ("long-full", "long-8gb")]
    return [f"{recipe['rounds_per_minute']:.1f}", f"{recipe['peak_gb']:.2f}", f"{recipe['planned_peak_gb']:.1f}",
            f"{paper['rounds_per_minute']:.1f}", paper["max_new_tokens"], spread(long, "{:.2f}")]


def h200_generation() -> list:
    bs = [backend(load(p)) for p in H200.values()]
    pushes = [b["push_s"] for b in bs if b["push_s"]]
    return [spread([b["generated_tokens_per_s"] for b in bs], "{:,.0f}"), spread([1000 * p for p in pushes], "{:.0f}")]


def px_aim_32() -> list:
    """How many strangers aimed hints, and the most dials that failed at any node in the attack."""
    d = load("hostile-px-aim-32-h100.json")
    (run,) = d["runs"]
    return [run["hostile"], max(n["dial_failed"] for n in run["phases"]["attack"]["nodes"].values())]


GPU_PAGE = "docs/bench/gpu.md"
CLAIMS += [
    Claim(GPU_PAGE, "**Swarm against silo at the paper's round**", gpu_grid),
    Claim(GPU_PAGE, "**A node's round on an H200**", h200_round),
    Claim(GPU_PAGE, "**Generation on the H200**", h200_generation),
    Claim(GPU_PAGE, "**Not measured on a GPU**", lambda: []),
    Claim(GPU_PAGE, "On the H100 machine's 16 CPU cores", px_aim_32),
]


# --- docs/bench/speed.md -------------------------------------------------------------------------------------------

SAMPLING = "sampling-decode-step-vs-1e47067-4seeds-2cpu.json"


def doctor_on_cpu() -> list:
    """The doctor pairs (rounds a minute, tokens a second, against the float32 sampler), the float32 sampler's own
    bench, Gemma's, the H200's."""
    ds = [load(p) for p in DOCTOR_PAIRS]
    now = ds[0::2]
    one, gemma = backend(load(DOCTOR_2CPU)), backend(load("doctor-bench-gemma3-270m-2cpu.json"))
    return [*doctor_round()[:2], *(f"{rpm(d):.2f}" for d in now),
            spread([backend(d)["generated_tokens_per_s"] for d in now], "{:.0f}"),
            *(f"{rpm(a) / rpm(c):.2f}x" for a, c in zip(now, ds[1::2])), f"{one['rounds_per_minute']:.2f}",
            f"{one['generated_tokens_per_s']:.0f}", f"{gemma['rounds_per_minute']:.2f}", f"{gemma['generated_tokens_per_s']:.0f}",
            f"{rpm(load(DOCTOR_H200)):.1f}"]


def sampler(d: dict, which: str) -> dict:
    (s,) = [s for s in d["samplers"] if s["sampler"].startswith(which)]
    return s


def sampling_speed() -> list:
    """The copies' sampler against 1e47067's over the seeds (and seed by seed), and the float32 sampler's."""
    d, old = load(SAMPLING), load("sampling-smollm2-135m-2cpu.json")
    now, then = sampler(d, "current"), sampler(d, "at 1e47067")
    per_seed = [a["generated_tokens_per_s"] / b["generated_tokens_per_s"] for a, b in zip(now["per_seed"], then["per_seed"])]
    f32, f32_then = sampler(old, "current"), sampler(old, "at 1e47067")
    return [f"{now['generated_tokens_per_s']:.0f}", f"{then['generated_tokens_per_s']:.0f}",
            f"{now['generated_tokens_per_s'] / then['generated_tokens_per_s']:.2f}x", len(per_seed),
            f"{min(per_seed):.2f} to {max(per_seed):.2f}x", f"{f32['generated_tokens_per_s']:.0f}",
            f"{f32_then['generated_tokens_per_s']:.0f}", f"{f32['generated_tokens_per_s'] / f32_then['generated_tokens_per_s']:.2f}x"]


def trained_round() -> list:
    d, old = load(SAMPLING), load("round-smollm2-135m-recipe-2cpu.json")
    now, then = sampler(d, "current"), sampler(d, "at 1e47067")
    first = old["rows"][0]
    return [d["tasks"], d["completions"], f"{now['rounds_per_minute']:.2f}", f"{now['generate_s']:.2f}", f"{now['step_s']:.1f}",
            f"{now['rounds_per_minute'] / then['rounds_per_minute']:.2f}x", f"{first['rounds_per_minute']:.2f}",
            f"{first['round_s']:.1f}"]


def bfloat16_step() -> list:
    """The step in float32 then with bfloat16 products, and the learning check's expected held-out gap."""
    (f32,), (bf16,) = (load(f"training-bf16-step-smollm2-135m-2cpu/{k}.json")["rows"] for k in ("float32", "bfloat16"))
    s = shape("autocast-check-2cpu", "smollm2-bf16 4/0")
    check = grid("autocast-check-2cpu")["smollm2-bf16 4/0"]["expected_vs_silo"]["all"]
    return [f"{f32['train_s']:.1f}", f"{bf16['train_s']:.1f}", f"{f32['train_s'] / bf16['train_s']:.2f}x",
            load("training-bf16-step-smollm2-135m-2cpu/bfloat16.json")["tasks"], f"{f32['peak_rss_gb']:.2f}",
            f"{bf16['peak_rss_gb']:.2f}", s["seeds"], s["rounds"], stats(check), f"{check['mde']:.3f}"]


def collector() -> list:
    """The collector's time a round over every node of the demo runs, and its share of the round."""
    nodes = [n for r in load("demo-gc-freeze-2cpu.json")["runs"] for n in r["nodes"].values()]
    share = mean(n["seconds_gc_per_round"] * n["rounds_per_min"] / 60 for n in nodes)
    return [spread([1000 * n["seconds_gc_per_round"] for n in nodes], "{:.1f}"), f"{100 * share:.2f}%"]


def generation() -> list:
    own = load("generation-tiny-a-transformers-2cpu.json")["results"]
    vllm = [r for r in load("generation-tiny-a-2cpu.json")["results"] if r["backend"] == "vllm"]
    return [f"{the(r['tokens_per_s'] for r in own):,.0f}", f"{the(r['tokens_per_s'] for r in vllm):,.0f}"]


SPEED = "docs/bench/speed.md"
CLAIMS += [
    Claim(SPEED, "**A node's SmolLM2-135M round**", doctor_on_cpu),
    Claim(SPEED, "**Sampling the recipe round**", sampling_speed),
    Claim(SPEED, "**The round with every completion trained**", trained_round),
    Claim(SPEED, "**The training step with bfloat16 products**", bfloat16_step),
    Claim(SPEED, "**Beside other work**", lambda: contention(percent=True)),
    Claim(SPEED, "**Python's collector**", collector),
    Claim(SPEED, "**Generation backends**", generation),
]


# --- docs/bench/soak.md --------------------------------------------------------------------------------------------

def flag(command: str | list, name: str) -> str:
    """A flag's value in a JSON's recorded command."""
    words = command.split() if isinstance(command, str) else command
    return words[words.index(name) + 1]


def churn() -> list:
    from bench_churn import summarize as churn_summary

    d = load("churn-2cpu.json")
    s = churn_summary(d["restarts"])
    return [flag(d["command"], "--nodes"), f"{float(flag(d['command'], '--duration')) / 60:.0f}", s["peer_id_kept"],
            s["restarts"], f"{s['s_to_first_round']['median']:.1f}"]


@cache
def _soak(path: str) -> dict:
    from bench_soak import summarize as soak_summary

    return soak_summary(_json(path))


def soak(path: str) -> tuple[dict, dict]:
    """A soak's raw record and what the benchmark's own summary makes of it."""
    return load(path), _soak(path)


def lost(rounds: list) -> int:
    numbers_ = [r for _, r in rounds]
    return numbers_[-1] - numbers_[0] + 1 - len(numbers_) if numbers_ else 0


def two_hours() -> list:
    """Nodes, the SmolLM2 node's span, errors, rounds lost, restarts, node0's RSS slope, its churn pace where the pace
    had levelled (the last cycle) against calm."""
    d, s = soak("soak-cpu-2cpu.json")
    smollm2 = d["processes"]["smollm2"]["samples"]
    pace = s["survivors"]["node0"]["pace"]
    last = max(p["cycle"] for p in pace)
    calm, churned = ([p["rounds_per_min"] for p in pace if p["cycle"] == last and p["kind"] == kind] for kind in ("calm", "churn"))
    return [d["args"]["nodes"], f"{(smollm2[-1]['t'] - smollm2[0]['t']) / 60:.0f}", sum(s["error_lines"].values()),
            sum(lost(d["processes"][n]["rounds"]) for n in s["survivors"]), s["peer_id_kept"], s["restarts"],
            f"{s['survivors']['node0']['slopes_per_hour']['rss_mb']['slope']:+.1f}", f"{the(churned) / the(calm):.2f}"]


def length_flood() -> list:
    d, s = soak("soak-ab-length-2cpu.json")
    v = s["survivors"]["node0"]["vs_calm"]["length"]
    return [v["cycles"], f"{v['pace']['mean']:.2f} ± {v['pace']['ci95']:.2f}", f"{v['per_core']['mean']:.2f} ± {v['per_core']['ci95']:.2f}"]


def round_work() -> list:
    """A lone node's wall time a round at its last window, a fresh swarm node's CPU a round at its first, and how far
    the calm swarm's CPU a round moved over its windows."""
    lone = load("round-work-lone-2cpu.json")["nodes"]["lone"]["windows"]
    calm = load("round-work-calm-2cpu.json")
    node0 = calm["nodes"]["node0"]
    return [f"{60 / lone[-1]['rounds_per_min']:.3f}", f"{node0['windows'][0]['cpu_s_per_round']:.3f}",
            load("soak-calm-2cpu.json")["args"]["nodes"], f"{100 * (node0['cpu_s_per_round_spread']['max_over_min'] - 1):.0f}%",
            f"{len(node0['windows']) * calm['window_s'] / 60:.0f}"]


SOAK = "docs/bench/soak.md"
CLAIMS += [
    Claim(SOAK, "**Churn**", churn),
    Claim(SOAK, "**Two hours**", two_hours),
    Claim(SOAK, "**The length flood's cost**", length_flood),
    Claim(SOAK, "**Tiny-a's pace drift", round_work),
    Claim(SOAK, "**Disk**", lambda: [f"{load('soak-rotate-4mb-2cpu.json')['args']['metrics_rotate_mb']:.0f}"]),
]


# --- docs/bench/network.md -----------------------------------------------------------------------------------------

def gossip_row(path: str, nodes: int) -> dict:
    (row,) = [r for r in load(path)["results"] if r["nodes"] == nodes]
    return row


def gossip() -> list:
    """Delivery and p95 latency at 20 messages a second on 4 and 8 nodes and at 10 on 8, with what a message costs."""
    four, eight, slow = gossip_row("gossip-20msgs-2cpu.json", 4), gossip_row("gossip-20msgs-2cpu.json", 8), gossip_row("gossip-10msgs-2cpu.json", 8)
    every = load("gossip-20msgs-2cpu.json")["results"]
    delivered = lambda r: f"{100 * r['delivery_ratio']:.2f}%".replace(".00%", "%")  # noqa: E731
    return [f"{the(round(r['message_bytes'] / 1000, 1) for r in (*every, slow))}", four["nodes"], f"{four['rate_total_msg_s']:.0f}",
            delivered(four), f"{four['latency_p95_ms']:.1f}", eight["nodes"], f"{eight['rate_total_msg_s']:.0f}", delivered(eight),
            f"{eight['latency_p95_ms']:,.0f}", spread([r["cpu_ms_per_message_per_node"] for r in every], "{:.1f}"), eight["nodes"],
            slow["nodes"], f"{slow['rate_total_msg_s']:.0f}", delivered(slow), f"{slow['latency_p95_ms']:.0f}"]


def shards() -> list:
    """Simulated CPU a round from the fewest to the most nodes, one topic's at the most; the real processes' messages
    and CPU a round with shards and on one topic."""
    sim, one = load("simulate-swarm-shards.json")["results"], load("simulate-swarm-one-topic-10000.json")["results"]
    real, topic = load("gossip-rounds-shards-2cpu.json")["results"], load("gossip-rounds-one-topic-2cpu.json")["results"]
    ends = (min(sim, key=lambda r: r["nodes"]), max(sim, key=lambda r: r["nodes"]))
    (whole,) = one
    return [*(f"{r['cpu_ms_per_round_mean']:.0f}" for r in ends), *(f"{r['nodes']:,}" for r in ends),
            f"{whole['cpu_ms_per_round_mean'] / 1000:.0f}", f"{whole['nodes']:,}", ", ".join(str(r["nodes"]) for r in real),
            *(spread([r[k] for r in rs], fmt) for rs in (real, topic)
              for k, fmt in (("messages_handled_per_round_per_node", "{:.1f}"), ("cpu_ms_per_round_per_node", "{:.0f}"))),
            f"{100 * the(r['delivery_ratio'] for r in (*real, *topic)):.0f}%"]


def lossy_path() -> list:
    d = load("gossip-lossy-path-2cpu.json")
    rtt, loss = d["path_rtt_ms_loss"]
    return [f"{rtt:.0f}", f"{100 * loss:.0f}%", f"{100 * the(r['delivery_ratio'] for r in d['results']):.0f}%",
            *(x for r in d["results"] for x in (f"{r['latency_p95_ms']:.0f}", r["nodes"]))]


def punch() -> list:
    """Each router kind's direct connections over attempts, its Wilson interval, how many at the first punch."""
    from bench_punch import summary

    runs_ = load("punch-2cpu.json")["runs"]
    s = summary(runs_)
    masq, eim, sym = s["masquerade"], s["eim"], s["symmetric"]
    interval = lambda low, high: f"{low + 0.0} to {high}"  # noqa: E731  (+ 0.0: Wilson's low end at 0 rounds to -0.0)
    return [f"{the(r['rtt_ms'] for r in runs_):.0f}", f"{100 * the(r['loss'] for r in runs_):.0f}%",
            masq["direct"], masq["attempts"], eim["direct"], eim["attempts"],
            interval(*the(tuple(c["share_95ci"]) for c in (masq, eim))), masq["direct_at_first_punch"],
            eim["direct_at_first_punch"], sym["direct"], sym["attempts"], interval(*sym["share_95ci"])]


NETWORK = "docs/bench/network.md"
CLAIMS += [
    Claim(NETWORK, "**Gossip on one machine**", gossip),
    Claim(NETWORK, "**Rollout shards keep a node's cost flat**", shards),
    Claim(NETWORK, "**Real paths**", lossy_path),
    Claim(NETWORK, "**Hole punching between home routers**", punch),
]


# --- docs/bench/hostile.md -----------------------------------------------------------------------------------------

def flooded(path: str, hostile_ids: int = 6) -> dict:
    """A flood's arm of `hostile_ids` identities, as the bench summarised its runs."""
    (row,) = [r for r in load(path)["summary"] if r["hostile"] == hostile_ids]
    return row


def share(path: str) -> str:
    return f"{100 * flooded(path)['share_of_no_flood']:.0f}%"


def junk() -> list:
    """The least honest share any junk topology kept, the groups inspected a round after and before the proven-first
    order, and the neighbour's pace beside the wrong-answer flood and without it."""
    least = min(flooded(p)["share_of_no_flood"] for p in ("hostile-junk-2cpu.json", "hostile-junk-direct-2cpu.json"))
    wrong = "hostile-wrong-answers-counted-2cpu.json"
    return [f"{100 * least:.1f}%", f"{flooded('hostile-junk-2cpu.json')['inspected_per_round']:.0f}",
            f"{flooded('hostile-junk-2cpu-before.json')['inspected_per_round']:.0f}",
            f"{flooded(wrong, 1)['neighbour_rounds_per_s']:.2f}", f"{flooded(wrong, 0)['neighbour_rounds_per_s']:.2f}"]


def samples_of(path: str) -> int:
    """How many samples the wrap was looked for in (the runs' `writes_wrap_of_N` field)."""
    (key,) = [k for k in load(path)["runs"][0] if k.startswith("writes_wrap_of_")]
    return int(key.rsplit("_", 1)[1])


def learned_floods() -> list:
    signal = ("hostile-masked-signal-2cpu.json", "hostile-wrapped-signal-2cpu.json")
    guarded = ("hostile-masked-guarded-2cpu.json", "hostile-wrapped-guarded-2cpu.json")
    shares = lambda paths: [100 * flooded(p)["share_of_no_flood"] for p in paths]  # noqa: E731
    scoped = "hostile-wrapped-scoped-2cpu.json"
    return [f"{min(shares(signal)):.0f} to {max(shares(signal)):.0f}%", flooded(signal[1])["writes_wrap_max"],
            samples_of(signal[1]), f"{min(shares(guarded)):.0f} to {max(shares(guarded)):.0f}%",
            share("hostile-masked-guarded-rerun-2cpu.json"), share("hostile-wrapped-guarded-rerun-2cpu.json"),
            flooded(scoped)["writes_wrap_max"], samples_of(scoped)]


def length() -> list:
    """The honest share under the length rule, and the padded messages a minute the target forwarded before the
    budget: what its neighbour accepted beside the flood over what it accepted without, a minute, to the hundred."""
    runs_ = load("hostile-length-budget-before-2cpu.json")["runs"]
    (calm,), (flood,) = ([r for r in runs_ if r["hostile"] == h] for h in (0, 6))
    extra = (flood["neighbour_accepted"] - calm["neighbour_accepted"]) / (flood["window_s"] / 60)
    return [share("hostile-length-signal-after-2cpu.json"), f"{round(extra, -2):.0f}"]


def shard_levels() -> list:
    finals = [s for p in ("hostile-level-hijack-final-2cpu.json", "hostile-level-hijack-final-3x30-2cpu.json")
              for s in load(p)["summary"]]
    ids, reached, stayed, seeds, of = level_grind(*hostile("level-computable"))
    return [*sorted({s["hostile"] for s in finals}), *sorted({s["size"] for s in finals}), len(finals), ids, stayed, seeds,
            of, reached]


def relay_cpu(with_stranger: bool) -> list[float]:
    """The relay's CPU a round in the attack window over the mean of the windows around it, in percent, each seed."""
    runs_ = [r for r in load("hostile-relay-abuse-control-2cpu.json")["runs"] if bool(r["hostile"]) == with_stranger]
    cpu = lambda r, k: r["phases"][k]["cpu_s_per_round"]  # noqa: E731
    return [100 * (cpu(r, "attack") / mean((cpu(r, "before"), cpu(r, "after"))) - 1) for r in runs_]


def relays() -> list:
    (squat,), (computable,) = (load(f"hostile-relay-{k}-after-2cpu.json")["runs"] for k in ("squat", "computable"))
    ids, relayed = relay_ids(load("hostile-relay-ids-after-2cpu.json"))
    aimed = [r for p in ("hostile-px-aim-after-2cpu.json", "hostile-px-aim-32-h100.json") for r in load(p)["runs"]]
    (redials,) = load("hostile-px-aim-redials-after-2cpu.json")["summary"]
    cost, control = relay_cpu(True), relay_cpu(False)
    return [squat["strangers_granted"], squat["relay_slots"], computable["strangers_granted"], computable["hostile"], ids,
            f"{relayed:.3f}", f"{min(cost):.1f} to {max(cost):.1f}%", f"{min(control):+.1f} to {max(control):+.1f}%",
            max(n["dial_failed"] for r in aimed for n in r["phases"]["attack"]["nodes"].values()),
            *sorted({r["hostile"] for r in aimed}), f"{redials['after_s'] / 60:.0f}"]


def free_answers() -> list:
    (fb,), (fa,) = (d["runs"] for d in hostile("dht-flood"))
    (eb,), (ea,) = (d["runs"] for d in hostile("dht-eclipse"))
    liar = [r for r in hostile("dialback-liar")[0]["runs"] if r["lie"] == "reached"][0]
    (forwarded,) = hostile("level-forward")[0]["summary"]
    most = lambda r: max(r["connections_by_node"].values())  # noqa: E731
    return [f"{fb['window_s']:.0f}", spread(list(fb["connections_by_node"].values()), "{}"), f"{fa['met_s']:.0f}", most(fa),
            f"{fa['window_s'] / 60:.0f}", most(ea), most(eb), liar["believed_public_s"], f"{liar['window_s']:.0f}",
            forwarded["deepest_level_attack"]]


HOSTILE = "docs/bench/hostile.md"
CLAIMS += [
    Claim(HOSTILE, "**Junk and wrong answers.**", junk),
    Claim(HOSTILE, "**Floods built to be learned.**", learned_floods),
    Claim(HOSTILE, "**The length flood**", length),
    Claim(HOSTILE, "**Shard levels hold.**", shard_levels),
    Claim(HOSTILE, "**Relays and peer exchange.**", relays),
    Claim(HOSTILE, "**Discovery against free answers.**", free_answers),
]
