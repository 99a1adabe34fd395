"""Where a peer is stronger than this node: pass rates per task family, this node's own and each peer's,
measured with this node's verifier.

A peer of another model family writes text this node would not (the `guarded` gate's reason to keep it
out), yet may solve a family this node mostly fails. The `scoped` rule lets such a peer's right rows into
the loss below the support gate, with a policy-shaped weight (trainer/loss.py, LUFFY's f(pi) = pi / (pi +
gamma)), only on the families where the peer is measurably stronger. Every count comes from re-scoring:
a peer's pass rate is the share of its completions this node's verifier found right, so what a sender
claims about its own answers never enters (docs/PROTOCOL.md section 4). Counts decay each round, as the
selection's other statistics do, and are saved in checkpoints.
"""

from __future__ import annotations

import math

from node.decayed import DecayedRates
from trainer.groups import RolloutGroup

MIN_ROWS = 16.0  # decayed completions of a family, ours and the peer's, before a comparison is made
CONFIDENCE_Z = 1.645  # one-sided 95%: the peer's pass rate must exceed ours by this many standard errors


class FamilyStrength:
    """Decayed right completions over completions per family for this node's own groups, and per (peer, family)
    for the groups it re-scored."""

    def __init__(self, max_keys: int):
        self.own = DecayedRates(max_keys)  # family -> [right, completions, last round]
        self.peers = DecayedRates(max_keys)  # "peer family" -> the same

    def observe_own(self, groups: list[RolloutGroup], round_: int) -> None:
        for g in groups:
            self.own.add(family(g), sum(g.correct), len(g.correct), round_)

    def observe(self, peer: str, group: RolloutGroup, round_: int) -> None:
        self.peers.add(f"{peer} {family(group)}", sum(group.correct), len(group.correct), round_)

    def decay(self, factor: float) -> None:
        self.own.decay(factor)
        self.peers.decay(factor)

    def stronger(self, peer: str, fam: str) -> bool:
        """Whether `peer` passes `fam` more often than this node, by `CONFIDENCE_Z` standard errors of the
        difference (Beta(1, 1) posteriors on both), each with `MIN_ROWS` completions measured."""
        key = f"{peer} {fam}"
        if min(self.peers.counts.get(key, (0, 0))[1], self.own.counts.get(fam, (0, 0))[1]) < MIN_ROWS:
            return False
        (m_p, v_p), (m_o, v_o) = beta_moments(*self.peers.beta(key)), beta_moments(*self.own.beta(fam))
        return m_p - m_o > CONFIDENCE_Z * math.sqrt(v_p + v_o)

    def state_dict(self) -> dict:
        return {"own": self.own.counts, "peers": self.peers.counts}

    def load_state_dict(self, state: dict) -> None:
        self.own.counts = {k: list(v) for k, v in state.get("own", {}).items()}
        self.peers.counts = {k: list(v) for k, v in state.get("peers", {}).items()}


def family(group: RolloutGroup) -> str:
    return group.task.ref.dataset


def beta_moments(a: float, b: float) -> tuple[float, float]:
    """Mean and variance of Beta(a, b)."""
    return a / (a + b), a * b / ((a + b) ** 2 * (a + b + 1))
