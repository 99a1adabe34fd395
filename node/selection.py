"""Swarm sampling: which rollout groups take a round's training slots.

GRPO learns only from a group whose rewards differ: when every completion of a task scored the
same, the group's advantages are zero and it adds nothing to the gradient, yet it still took one
of the round's I + J slots. A node re-scores every external group with its own verifier before
training, so it can see for free whether a group carries signal *for this node*. The SAPO paper
(arXiv 2509.08721, sections 3.2 and 5) has every node discard zero-advantage rollouts from the swarm's
pool, then sample the rest uniformly: that is `signal` below (the paper does not say how a node gets
advantages for a peer's rollouts; here they come from re-scoring the regenerated task). Gensyn's public
rl-swarm (early 2026) samples peers' questions uniformly with no reward filter, and scores them
against the answer the sender put in the payload. Here:

- `uniform`: the first J usable groups in the pool's fair order (one per peer, newest first).
- `signal`: the same order, but a group whose re-scored rewards are all equal is dropped and the
  next one inspected, until J informative groups, the pool's end or `max_inspect` re-scorings.
- `guarded` (the default): `signal`, where a group counts as signal only by the rows this node would
  push up and that survive its *support gate*: a completion that scored above its group's mean is used
  only if this node's policy finds it at least as likely, in mean token log-prob, as the `support_quantile`
  of the node's own recent completions (its own writing, remembered over `support_window` rows; no
  external group is taken before that reference exists). Why: SmolLM2-135M beside a tiny-a node lost
  held-out accuracy mid-run (0.28 against 0.47 alone). Its own completions work the sum out on one line
  and then answer (`90 + 86 = 176.\n<answer>176</answer>`, mean log-prob -0.1 to -0.4 per token, 0% bare);
  tiny-a's right answers are a bare `<answer>4</answer>` (-1.3 per token under SmolLM2 on arith, -2.8 on
  reverse, a family SmolLM2 does not have), far above the trainer's fixed -5 cut-off, so they were pushed
  up as if on-policy and taught SmolLM2 to answer without working (docs/bench/diagnose-smollm2-tiny-a-2cpu.json).
  The same gate stops text wrapped around a right answer (a prefix, an advertisement, an instruction) and
  groups whose right rows nobody would write: they are dropped (`off_support`) before taking a slot, and
  never prove their sender. The cut-off is learned from the node's own samples, so it follows the node as
  it sharpens, and differs by model without a hand-set number.
- `scoped`: `guarded`, except where a peer is measurably stronger: on a task family whose re-scored pass
  rate for that peer beats this node's own recent one (`node.strength`), the peer's right rows below the
  gate are kept and trained with LUFFY's policy-shaped weight instead of the clipped ratio (trainer/loss.py),
  which moves the policy little on tokens it finds far less likely than `shaping_gamma`. Elsewhere the gate
  stands, so a peer's right answer on a family where this node does as well stays out. Why: a peer of another
  model family solves what this node cannot, in text this node would not write, and `guarded` alone never
  lets that text in (SmolLM2-135M beside tiny-a inspected 400-700 groups a run and used none). Experimental:
  not the default until it beats `guarded` with its defences kept (the --hetero and --gemma grids of
  scripts/bench/sapo_experiment.py, docs/bench/learning.md).
- `adaptive`: `signal`, inspecting first the groups most likely to carry signal: peers share the
  inspections in proportion to a Thompson draw from the decayed share of their groups that did,
  with a floor of uniformly random picks so that no peer is written off. A first version also put
  each peer's tasks near this node's own 50% pass rate first, per dataset and config; measured, that
  starved the family the node already solved well (held-out 0.82 against 0.92 under `signal`, 3 seeds)
  because a family's pass rate says little about one group's, and the signal filter already drops the
  groups that carry nothing. It was taken out.

Peer ids cost nothing, so every rule first splits the pool: groups of *proven* peers (a group of
theirs carried signal here recently: decayed count of informative groups >= `PROVEN_HITS`) are
inspected first, in the rule's order; groups of unproven peers get the `explore` share of the
inspections (all of them while no peer is proven), so that six fresh identities flooding useless groups
cannot take the honest peers' inspections, while a newcomer can still prove itself. Once some peer is
proven, unproven groups get at most `explore` x `max_inspect` inspections a round even when the proven
peers' groups run out: under a flood of 60 useless groups a round, a node that looked at every one
spent ~27 regenerations a round on them and slowed down as much as its honest neighbour
(scripts/bench/bench_hostile.py). A peer already *tried* (`TRIED` inspections, decayed) that has not proven
itself gets that share even while no peer is proven, behind the groups of peers not yet tried: beside a prolific
weak peer and no other, a SmolLM2 node under `guarded` inspected ~30 of its groups a round and dropped every one,
the gate alone 2.7 s of a 5.3 s round on an H100 (docs/bench/gpu.md, "The paper's round of 8 groups, 80 rounds, on an H100"). The pool applies the same split to what it keeps (`p2p.pool`), from the
same statistic (`proven`). A peer whose completions run `VERBOSE_RATIO` times as long as this node's own on the
same families is never proven, however useful its groups (`Lengths`: right but padded answers cost every receiver
training time and teach verbosity); the trainer reads at most `max_new_tokens` of any external completion, and a
row past that is masked from the loss, so a group whose rows to push up all run past it takes no slot (`too_long`).

Local groups get the same treatment when `local_overdraw` > 1: more tasks are drawn and sampled
than there are local slots, and informative groups fill the slots first (DAPO's dynamic sampling,
paid for in generation). Everything a rule learns is a few decayed counters per peer and per task,
bounded in number and saved in checkpoints, so a resumed node chooses exactly as it would have.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Container, Iterator

from node.selection_config import GATED, SelectionConfig
from node.decayed import DecayedRates
from node.strength import FamilyStrength, family
from p2p.pool import PooledGroup, RolloutPool
from rewards import Task, TaskRef, regenerate
from rewards.config import TasksConfig
from rewards.gym import PREFIX as RG_PREFIX
from rewards.sandbox import SandboxError
from rewards.untrusted import UntrustedTasks
from trainer.groups import RolloutGroup, scored_group

log = logging.getLogger(__name__)


MIN_OWN_ROWS = 16  # own completions the support gate needs before it lets external text in
VERBOSE_RATIO = 3.0  # a peer whose completions run this many times as long as ours, family by family, is kept to explore
VERBOSE_GROUPS = 4.0  # groups of a peer (decayed) measured before its length is judged
OWN_LENGTH_EMA = 0.1  # weight of a round's own mean completion length per family
PROVEN_HITS = 0.25  # one informative group, decayed by 0.98 a round, keeps a peer proven for ~68 rounds
TRIED = 8.0  # inspections (decayed) after which an unproven peer has had its chance: Beta(1, 1) -> mean 0.1
PEER_TASKS = 64  # tasks of peers' unusable informative groups remembered for `when_short = peer_tasks`, newest kept


def informative(group: RolloutGroup) -> bool:
    """Whether GRPO gets any gradient from the group: its rewards are not all equal, and a row it would
    push up (above the group's mean) is left in the loss."""
    if len(set(group.rewards)) == 1:
        return False
    return any(group.used is None or group.used[i] for i in push_up(group))


class SupportGate:
    """The `guarded` rule's cut-off: the `quantile` of this node's own recent completions' mean token
    log-probs, each under the policy that wrote it (measured for free in the training step)."""

    def __init__(self, quantile: float, window: int):
        self.quantile = quantile
        self.own: deque[float] = deque(maxlen=window)

    def observe(self, own_logprobs: list[float]) -> None:
        self.own.extend(own_logprobs)

    def cutoff(self) -> float | None:
        """None until MIN_OWN_ROWS own rows are known (a round or two): no reference, no external text."""
        if len(self.own) < min(MIN_OWN_ROWS, self.own.maxlen):
            return None
        ranked = sorted(self.own)
        return ranked[min(len(ranked) - 1, int(self.quantile * len(ranked)))]

    @staticmethod
    def apply(group: RolloutGroup, logprobs: list[float], cutoff: float) -> int:
        """Mark the rows to push up (`push_up(group)`) whose mean token log-prob (`logprobs`, one per such
        row) falls below the cut-off as unused; returns how many."""
        kept = list(group.used) if group.used is not None else [True] * len(group.rewards)
        gated = 0
        for row, lp in zip(push_up(group), logprobs, strict=True):
            gated += kept[row] and lp < cutoff
            kept[row] = kept[row] and lp >= cutoff
        group.used = kept
        return gated


    @staticmethod
    def shape(group: RolloutGroup, logprobs: list[float], cutoff: float, floor: float | None) -> tuple[int, int]:
        """What `apply` would gate, kept in the loss with the trainer's policy-shaped weight instead (a peer
        stronger on the group's family: its right rows are what this node cannot yet write), except rows under
        `floor`, which the trainer masks: those are gated, so that text no node writes (a masked Sybil's) cannot
        make a group worth a slot. Returns how many rows were shaped and how many gated."""
        kept = list(group.used) if group.used is not None else [True] * len(group.rewards)
        shaped, gated = [False] * len(group.rewards), 0
        for row, lp in zip(push_up(group), logprobs, strict=True):
            if not kept[row] or lp >= cutoff:
                continue
            if floor is not None and lp < floor:
                kept[row], gated = False, gated + 1
            else:
                shaped[row] = True
        group.shaped = shaped
        if gated:
            group.used = kept
        return sum(shaped), gated


def push_up(group: RolloutGroup) -> list[int]:
    """The rows GRPO would push up: rewarded above their group's mean. Only these are gated (a row pushed
    down teaches nothing of its form), so the gate scores about half a group."""
    mean = sum(group.rewards) / len(group.rewards)
    return [i for i, r in enumerate(group.rewards) if r > mean]


def rows_to_gate(group: RolloutGroup) -> RolloutGroup:
    """The group cut to its rows to push up: what the support gate scores."""
    rows = push_up(group)
    return replace(group, completions=[group.completions[i] for i in rows], rewards=[group.rewards[i] for i in rows],
                   truncated=[group.truncated[i] for i in rows], completion_ids=None, correct=[], used=None)


@dataclass
class Pick:
    """The external groups of one round, and what it took to find them."""

    groups: list[RolloutGroup] = field(default_factory=list)
    inspected: int = 0  # pool groups regenerated and re-scored
    informative: int = 0  # of those, groups whose rewards differ
    dropped: Counter[str] = field(default_factory=Counter)  # pool groups taken out unused, by reason
    out_of_budget: bool = False  # the round's re-scoring budget ended the search
    gated: int = 0  # rows to push up that the support gate left out (`guarded`)
    shaped: int = 0  # rows to push up below the gate, kept with a policy-shaped weight (`scoped`, a stronger peer)
    gate_s: float = 0.0  # seconds spent computing this node's log-probs of them
    held_back: int = 0  # pool groups of peers already tried left out of the round's order (kept in the pool)
    peer_tasks: int = 0  # tasks of peers' unusable informative groups sampled here in the round's local slots


def mean_chars(group: RolloutGroup) -> float:
    return sum(map(len, group.completions)) / max(1, len(group.completions))


class Lengths:
    """How long this node's own completions run per task family, and how long each peer's run against them:
    Gensyn's study of attacks on decentralised GRPO found one that its defences let through, completions right
    but needlessly long, which cost every receiver training time and teach verbosity. A peer whose groups run
    `VERBOSE_RATIO` times as long as ours is never proven (it keeps to the `explore` share)."""

    def __init__(self, max_keys: int):
        self.own: dict[str, float] = {}  # dataset -> mean characters of our completions (an EMA over rounds)
        self.peers = DecayedRates(max_keys)  # peer -> [sum of its groups' length over ours, groups measured]

    def observe_own(self, groups: list[RolloutGroup]) -> None:
        by_family: dict[str, list[float]] = {}
        for g in groups:
            by_family.setdefault(g.task.ref.dataset, []).append(mean_chars(g))
        for dataset, lengths in by_family.items():
            mean = sum(lengths) / len(lengths)
            self.own[dataset] = mean if dataset not in self.own else (1 - OWN_LENGTH_EMA) * self.own[dataset] + OWN_LENGTH_EMA * mean

    def observe(self, peer: str, group: RolloutGroup, round_: int) -> None:
        own = self.own.get(group.task.ref.dataset)
        if own:  # a family we do not write ourselves has no measure
            self.peers.add(peer, mean_chars(group) / own, 1.0, round_)

    def verbose(self, peer: str) -> bool:
        entry = self.peers.counts.get(peer)
        return entry is not None and entry[1] >= VERBOSE_GROUPS and entry[0] > VERBOSE_RATIO * entry[1]


class Selector:
    """Chooses the round's external groups from the pool and orders its local groups; owns what the
    adaptive rule has learned (`state_dict` goes into checkpoints)."""

    def __init__(self, cfg: SelectionConfig, tasks: TasksConfig,
                 logprobs: Callable[[list[RolloutGroup]], list[list[float]]] | None = None,
                 fits: Callable[[list[str]], list[bool]] | None = None, floor: float | None = None,
                 held_out: Container[Task] = ()):
        """`logprobs`: each group's completions' mean token log-probs under this node's policy (the
        `guarded` rule's gate). `fits`: whether each external text fits the trainer's completion budget (a
        row that does not is left out of the loss, so it cannot make a group worth a slot; None: all fit).
        `floor`: the trainer masks external rows below this mean log-prob (`grpo.external_min_logprob`), so
        `scoped` never counts them as shaped rows. `held_out`: tasks this node never trains on (its evaluation's
        questions, `rewards.held_out`): a peer's group of one is dropped as `held_out`."""
        if cfg.rule in GATED and logprobs is None:
            raise ValueError(f"the {cfg.rule} rule needs the node's log-probs")
        self.cfg, self.tasks, self.logprobs, self.fits, self.floor = cfg, tasks, logprobs, fits, floor
        self.held_out = held_out
        self.peers = DecayedRates(cfg.max_tracked)  # share of inspected groups that carried signal
        self.lengths = Lengths(cfg.max_tracked)
        self.strength = FamilyStrength(cfg.max_tracked)  # where a peer passes more often than we do (`scoped`)
        self.support = SupportGate(cfg.support_quantile, cfg.support_window)
        self._peer_tasks: OrderedDict[str, Task] = OrderedDict()  # the newest last
        uses_gym = cfg.accept == "any" or any(d.name.startswith(RG_PREFIX) for d in tasks.datasets)
        self.untrusted = UntrustedTasks(cfg.regen_timeout_s, cfg.regen_memory_mb,
                                        warm=("reasoning_gym",) if uses_gym else ())

    def close(self) -> None:
        self.untrusted.close()

    def proven(self, peer: str) -> bool:
        """Whether groups of `peer` have carried learning signal here recently, at a length like ours. Read by
        the pool on the gossip thread: dict lookups, no lock needed."""
        entry = self.peers.counts.get(peer)
        return entry is not None and entry[0] >= PROVEN_HITS and not self.lengths.verbose(peer)

    def tried(self, peer: str) -> bool:
        """Whether `peer` has had its chance here: inspected `TRIED` times (decayed) without proving itself
        (a peer found forgotten after ~100 quiet rounds is fresh again)."""
        entry = self.peers.counts.get(peer)
        return entry is not None and entry[1] >= TRIED and entry[0] < PROVEN_HITS

    def local_tasks(self, slots: int) -> int:
        """How many local tasks to draw for `slots` local slots."""
        return math.ceil(slots * self.cfg.local_overdraw)

    def external(self, pool: RolloutPool, rng: random.Random, round_: int) -> Pick:
        """Up to J usable groups from the pool, re-scored here; the rest of what was looked at is dropped."""
        cfg, pick = self.cfg, Pick()
        cutoff = self.support.cutoff() if cfg.rule in GATED else None
        if cfg.external_groups == 0 or (cfg.rule in GATED and cutoff is None):
            return pick
        self.peers.decay(cfg.decay)
        self.lengths.peers.decay(cfg.decay)
        self.strength.decay(cfg.decay)
        filtering = cfg.rule != "uniform"
        deadline = time.monotonic() + cfg.budget_s
        gating: list[tuple[str, RolloutGroup]] = []  # informative by reward, waiting for the support gate
        for pooled in self._order(pool.groups(), rng, pick):
            if len(pick.groups) + len(gating) == cfg.external_groups:
                self._gate(gating, cutoff, pick, round_)  # one forward pass for the lot
            if len(pick.groups) == cfg.external_groups or (filtering and pick.inspected == cfg.max_inspect):
                break
            spare = deadline - time.monotonic() - cfg.regen_timeout_s
            if spare < 0 or not self.untrusted.ready(wait=spare):
                pick.out_of_budget = True  # the rest stay in the pool for the next round
                break
            if not pool.take(pooled):
                continue  # evicted by the p2p thread since the snapshot
            group = self._inspect(pooled, pick, round_)
            if group is None:
                continue
            signal = informative(group)
            if signal and cutoff is not None:
                gating.append((pooled.peer, group))
                continue
            self.peers.add(pooled.peer, float(signal), 1.0, round_)
            if filtering and not signal:
                if group.used is not None:  # informative by reward, its right rows past our budget
                    self._remember_task(group)
                pick.dropped["too_long" if group.used is not None else "uniform_rewards"] += 1
                continue
            pick.groups.append(group)
        self._gate(gating, cutoff, pick, round_)
        return pick

    def _inspect(self, pooled: PooledGroup, pick: Pick, round_: int) -> RolloutGroup | None:
        """The pooled group re-scored here, its length measured and its rows past our budget marked unused
        (they are masked from the loss anyway); None, counted in `pick`, when it cannot be used at all."""
        group, reason = self._rescore(pooled)
        if group is None:
            pick.dropped[reason] += 1
            return None
        pick.inspected += 1
        self.lengths.observe(pooled.peer, group, round_)
        self.strength.observe(pooled.peer, group, round_)
        if informative(group):
            pick.informative += 1
            if self.fits is not None and not all(fits := self.fits(group.completions)):
                group.used = fits
        return group

    def _gate(self, gating: list[tuple[str, RolloutGroup]], cutoff: float, pick: Pick, round_: int) -> None:
        """The support gate over groups informative by reward: a group that keeps a row to push up takes a
        slot and counts for its sender; one that keeps none is dropped and does not prove its sender."""
        if not gating:
            return
        started = time.monotonic()
        logprobs = self.logprobs([rows_to_gate(g) for _, g in gating])
        pick.gate_s += time.monotonic() - started
        for (peer, group), lps in zip(gating, logprobs):
            if self.cfg.rule == "scoped" and self.strength.stronger(peer, family(group)):
                shaped, gated = SupportGate.shape(group, lps, cutoff, self.floor)
                pick.shaped, pick.gated = pick.shaped + shaped, pick.gated + gated
            else:
                pick.gated += self.support.apply(group, lps, cutoff)
            useful = informative(group)
            self.peers.add(peer, float(useful), 1.0, round_)
            if useful:
                pick.groups.append(group)
            else:
                self._remember_task(group)
                pick.dropped["off_support"] += 1
        gating.clear()

    def _remember_task(self, group: RolloutGroup) -> None:
        """A task whose group carried signal here but whose text could not be used: sampled with our own model
        it may (`when_short = peer_tasks`). Only tasks of our own families, which rebuild without the sandbox."""
        ref = group.task.ref
        if self.cfg.when_short == "peer_tasks" and self.tasks.has(ref.dataset, ref.config):
            key = task_key(ref)
            self._peer_tasks.pop(key, None)
            self._peer_tasks[key] = group.task
            while len(self._peer_tasks) > PEER_TASKS:
                self._peer_tasks.popitem(last=False)

    def peer_tasks(self, n: int) -> list[Task]:
        """Up to `n` remembered peer tasks, newest first (kept until `took_peer_tasks`)."""
        return list(reversed(self._peer_tasks.values()))[:max(0, n)]

    def took_peer_tasks(self, tasks: list[Task]) -> int:
        """Forget `tasks`, sampled this round; returns how many."""
        for task in tasks:
            self._peer_tasks.pop(task_key(task.ref), None)
        return len(tasks)

    def observe_own(self, logprobs: list[float], groups: list[RolloutGroup] = (), round_: int = 0) -> None:
        """The round's own trained completions' mean token log-probs (the support gate's reference) and its
        own groups (the lengths and pass rates a peer's are measured against)."""
        self.support.observe(logprobs)
        self.lengths.observe_own(list(groups))
        self.strength.observe_own(list(groups), round_)

    def local(self, groups: list[RolloutGroup], slots: int) -> list[RolloutGroup]:
        """The `slots` local groups to train on, informative ones first."""
        if len(groups) <= slots:
            return groups
        return sorted(groups, key=lambda g: not informative(g))[:slots]  # stable: draw order within each kind

    def _order(self, candidates: list[PooledGroup], rng: random.Random, pick: Pick) -> Iterator[PooledGroup]:
        """Candidates in the order they are inspected; consumed only as far as the round needs. Counts in
        `pick` the groups of tried peers it leaves out, so that how often the tried-peer share acts is measured."""
        peers = {c.peer for c in candidates}
        proven, tried = {p: self.proven(p) for p in peers}, {p: self.tried(p) for p in peers}
        first = self._rule_order([c for c in candidates if proven[c.peer]], rng)
        share = math.ceil(self.cfg.explore * self.cfg.max_inspect)
        fresh = fair_order([c for c in candidates if not proven[c.peer] and not tried[c.peer]], rng)
        of_tried = fair_order([c for c in candidates if tried[c.peer]], rng)
        unproven = fresh + of_tried[:share]
        if any(map(self.proven, self.peers.counts)):
            unproven = unproven[:share]
        pick.held_back = len(of_tried) - sum(tried[c.peer] for c in unproven)
        rest = iter(unproven)
        while True:
            source, other = (rest, first) if rng.random() < self.cfg.explore else (first, rest)
            item = next(source, None)
            if item is None:
                yield from other
                return
            yield item

    def _rule_order(self, candidates: list[PooledGroup], rng: random.Random) -> Iterator[PooledGroup]:
        if self.cfg.rule != "adaptive":
            yield from fair_order(candidates, rng)
            return
        by_peer = peer_queues(candidates, key=lambda c: -c.created)
        # Weighted fair queueing over peers: a peer's k-th group comes at virtual time k / theta, theta
        # a Thompson draw of the share of its groups that carried signal here. Peers share the slots in
        # proportion to their usefulness; ranking groups by theta alone gave the best peer every slot
        # (1.5 peers per round instead of 2.9 under `signal`, measured) and lost the swarm's variety.
        theta = {p: max(rng.betavariate(*self.peers.beta(p)), 1e-6) for p in sorted(by_peer)}
        ranked = [c for _, _, c in sorted(((k + 1) / theta[p], p, c) for p, queue in by_peer.items()
                                          for k, c in enumerate(queue))]
        while ranked:
            yield ranked.pop(rng.randrange(len(ranked)) if rng.random() < self.cfg.explore else 0)

    def _rescore(self, pooled: PooledGroup) -> tuple[RolloutGroup | None, str]:
        """Nothing the sender claims is used beyond the task reference and the texts: the task is
        rebuilt from the reference and every completion is scored by this node's verifier."""
        g = pooled.group
        own = self.tasks.has(g.dataset, g.config)
        if not (own or self.cfg.accept == "any"):
            return None, "not_accepted"
        try:
            task, scores = self.untrusted.score(TaskRef(g.dataset, g.config, g.seed, g.index), g.completions,
                                                self.tasks.format_weight, trusted=own)
        except SandboxError as e:  # untrusted reference: any failure to rebuild or score it drops the group
            log.debug("cannot use %s/%s from %s: %s", g.dataset, g.index, pooled.peer, e)
            return None, e.reason
        if task in self.held_out:
            return None, "held_out"
        return scored_group(task, g.completions, self.tasks.format_weight, source=pooled.peer, scores=scores), ""

    def state_dict(self) -> dict[str, Any]:
        return {"peers": self.peers.counts, "own_logprobs": list(self.support.own),
                "own_lengths": self.lengths.own, "peer_lengths": self.lengths.peers.counts,
                "strength": self.strength.state_dict(),
                "peer_tasks": [[t.ref.dataset, t.ref.config, t.ref.seed, t.ref.index] for t in self._peer_tasks.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.peers.counts = {k: list(v) for k, v in state["peers"].items()}
        self.lengths.own = dict(state.get("own_lengths", {}))  # absent in checkpoints before the length bound
        self.lengths.peers.counts = {k: list(v) for k, v in state.get("peer_lengths", {}).items()}
        self.strength.load_state_dict(state.get("strength", {}))  # absent in checkpoints before the scoped rule
        self._peer_tasks = OrderedDict((task_key(t.ref), t) for t in (regenerate(TaskRef(*ref)) for ref in state.get("peer_tasks", [])))
        self.support.own.clear()
        self.support.observe(state.get("own_logprobs", []))  # absent in checkpoints before the guarded rule


def task_key(ref: TaskRef) -> str:
    return json.dumps([ref.dataset, ref.config, ref.seed, ref.index], sort_keys=True)


def fair_order(candidates: list[PooledGroup], rng: random.Random) -> list[PooledGroup]:
    """One group per peer in random peer order, round after round, each peer's newest first, so
    that J spreads over as many peers as hold groups."""
    by_peer = peer_queues(candidates, key=lambda c: -c.created)
    peers = sorted(by_peer)
    rng.shuffle(peers)
    queues = [by_peer[p] for p in peers]
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


def peer_queues(candidates: list[PooledGroup], key: Callable[[PooledGroup], Any]) -> dict[str, list[PooledGroup]]:
    """Each peer's candidates, in `key` order."""
    by_peer: dict[str, list[PooledGroup]] = {}
    for c in sorted(candidates, key=key):
        by_peer.setdefault(c.peer, []).append(c)
    return by_peer
