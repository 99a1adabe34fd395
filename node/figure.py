"""The local swarm's figure (`sapo swarm`'s summary.png): each arm's training reward and held-out accuracy.
matplotlib is imported only here, when a whole run is drawn; nothing else in the node needs it."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Curves(Protocol):
    """What the figure reads of a node: its model, its metrics rows, and whether it ran a length of its own."""
    preset: str
    rows: list[dict]
    companion: bool


def plot(arms: dict[str, list[Curves]], path: Path, title: str) -> None:
    """Each arm's mean over its nodes (one model's nodes apart from another's) with a band from its lowest to
    its highest node: readable at any number of nodes. Companions are left out: they run for a length of their own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_e) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"swarm": "tab:blue", "alone": "tab:gray"}
    styles = ["-", "--", ":", "-."]
    models = list(dict.fromkeys(c.preset for nodes in arms.values() for c in nodes if not c.companion))
    for arm, nodes in arms.items():
        for model in models:
            group = [c for c in nodes if c.preset == model and not c.companion]
            if not group:
                continue
            label = f"{arm}: {len(group)} {model} node{'s' if len(group) > 1 else ''}"
            style = {"color": colors[arm], "linestyle": styles[models.index(model) % len(styles)]}
            _band(ax_r, [_smoothed(c.rows) for c in group], label, style)
            _band(ax_e, [{r["round"]: r["eval_accuracy"] for r in c.rows if r.get("eval_accuracy") is not None}
                         for c in group], label, {**style, "marker": "."})
    ax_r.set(title="training reward (moving mean; band: lowest to highest node)", xlabel="round", ylabel="reward")
    ax_e.set(title="held-out accuracy (greedy)", xlabel="round", ylabel="accuracy")
    for ax in (ax_r, ax_e):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _smoothed(rows: list[dict]) -> dict[int, float]:
    """Reward per round, as a moving mean over a twentieth of the run."""
    trained = [r for r in rows if r["round"] > 0]
    window = max(1, len(trained) // 20)
    return {r["round"]: sum(x["reward_mean"] for x in trained[max(0, i - window + 1): i + 1]) / min(window, i + 1)
            for i, r in enumerate(trained)}


def _band(ax, curves: list[dict[int, float]], label: str, style: dict) -> None:
    """The mean of `curves` (round -> value) over the rounds they all have, between their lowest and highest."""
    rounds = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    if not rounds:
        return
    values = [[c[r] for c in curves] for r in rounds]
    ax.plot(rounds, [sum(v) / len(v) for v in values], label=label, **style)
    ax.fill_between(rounds, [min(v) for v in values], [max(v) for v in values], color=style["color"], alpha=0.15,
                    linewidth=0)
