"""The node's round loop: draw tasks, sample, score, train, sync weights, share, evaluate."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, replace

import torch

from node.config import NodeConfig
from node.lifecycle import StopSignal
from node import collector, planner
from node.eval_cache import EvalCache, evaluation_key
from node.metrics import Evaluation, MetricsLog, RoundMetrics
from node.pressure import MemoryWatch, round_peak_reader
from node.progress import Progress
from node.selection import Selector, informative
from node.share import publish_round, self_messages
from node.status import StatusBoard, StatusServer
from node.supervise import ComponentFailed, describe, retrying
from node.threads import ThreadGovernor
from node.watch import Collapsed, LearningWatch, probe_rounds
from p2p.identity import load_or_create, seed_of
from p2p.pool import RolloutPool
from p2p.service import Gossip
from rewards import Task, TaskSource
from rewards.held_out import held_out
from rewards.scoring import group_carries_signal
from trainer import allocator, checkpoint
from trainer.generation import Cancel, SamplingParams, make_generator, never
from trainer.groups import RolloutGroup
from trainer.grpo import GRPOTrainer, StepStats, refresh_lr
from trainer.memory import GB
from trainer.policy import ModelLoadError, finite_weights, load_policy
from trainer.rollout import accuracy, accuracy_by_dataset, evaluate, mean_reward, rollout

log = logging.getLogger(__name__)


# what a resume reads from a checkpoint (`_restore`); "lora" and "selection" are newer and optional
STATE_KEYS = ("model", "task_position", "weight_version")
TRAINER_KEYS = ("optimizer", "scheduler", "torch_rng")
PEER_WAIT_S = 120.0


def round_seed(seed: int, round_: int) -> int:
    """Sampling seed of a round: a resumed run samples exactly what an uninterrupted one would."""
    return (seed * 1_000_003 + round_) % (2**63)


def with_seed(cfg: NodeConfig) -> NodeConfig:
    """`run.seed` as given; unset, a node in a swarm takes the seed of its key (created here if new), so that nodes
    started alike (compose replicas, two users' defaults) draw their own tasks and samples and a restart the same
    ones, and a node alone takes 0. Either steps off the held-out set's seed."""
    if cfg.run.seed is not None:
        return cfg
    seed = seed_of(load_or_create(cfg.key_file())) if cfg.p2p.enabled else 0
    if seed == cfg.tasks.eval_seed:
        seed += 1
    source = f"from the node's key {cfg.key_file()}" if cfg.p2p.enabled else "a node without a network"
    log.info("run.seed %d (%s)", seed, source)
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"seed": seed})})


def families(tasks: list[Task]) -> Counter:
    """Tasks per family: the learning watch's sample sizes."""
    return Counter(t.ref.dataset for t in tasks)


def probe_fields(probe: Evaluation) -> dict:
    """The early probe's fields of a metrics line (kept apart from the full evaluation's `eval_*`)."""
    return {"probe_accuracy": probe.accuracy, "probe_by_dataset": probe.by_dataset}


class Node:
    def __init__(self, cfg: NodeConfig, progress: Progress | None = None, status_socket: socket.socket | None = None):
        """`status_socket`: the status endpoint's socket, bound before the model loaded (`node.preflight`)."""
        self.cfg = cfg
        self._status_socket = status_socket
        if cfg.run.torch_threads:
            torch.set_num_threads(cfg.run.torch_threads)
        # unless set, the threads follow the cores other work leaves free (node/threads.py)
        self.threads = None if cfg.run.torch_threads else ThreadGovernor(torch.set_num_threads, threads=torch.get_num_threads())
        heap = allocator.keep_freed_memory()  # a CPU step's tensors reuse the last step's pages (trainer/allocator.py)
        out = cfg.run.out_dir
        out.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg = with_seed(cfg)
        self.checkpoints = out / "checkpoints"
        self.metrics = MetricsLog(out / "metrics.jsonl", rotate_bytes=int(cfg.run.metrics_rotate_mb * 1e6))
        self.progress = progress or Progress(cfg.run.rounds, out.resolve().name)

        resumed = checkpoint.load_latest(self.checkpoints, STATE_KEYS, TRAINER_KEYS)
        if resumed and resumed.state.get("model") != cfg.model.name:
            raise checkpoint.CheckpointError(
                f"{resumed.path} continues model {resumed.state.get('model')!r}, not {cfg.model.name!r}: "
                "resume with the same model.name or choose a new --out"
            )
        if resumed and cfg.model.lora.enabled == "auto" and "lora" in resumed.state:  # a checkpoint's kind stands
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={
                "lora": cfg.model.lora.model_copy(update={"enabled": resumed.state["lora"]})})})
        fitted = planner.fit(cfg)  # before any weights load: a plan that cannot fit stops here
        planner.log_plan(fitted.plan)
        planner.log_settings(fitted.settled)
        self.cfg = cfg = fitted.cfg
        self.plan = fitted.plan
        self.memory = MemoryWatch(self.plan.peak_bytes, round_peak_reader(self.plan.device.kind), self.plan.peak_at,
                                  heap=heap and self.plan.device.kind != "cuda")
        try:
            self.policy = load_policy(cfg.model, weights_from=resumed.model_dir if resumed else None,
                                      tokenizer=fitted.tokenizer, source=fitted.source)
        except ModelLoadError as e:
            if resumed is None or str(resumed.model_dir) not in str(e):
                raise
            raise checkpoint.CheckpointError(f"checkpoint {resumed.path} is unreadable ({e}); move it aside to resume "
                                             "from an older one") from None
        self.generator = make_generator(cfg.generation, self.policy)
        self.eval_tasks = TaskSource(cfg.tasks.eval_mix(), seed=cfg.tasks.eval_seed).draw(cfg.tasks.eval_size)
        self.held_out = held_out(self.eval_tasks)  # never trained on, drawn here or taken from a peer
        self.tasks = TaskSource(cfg.tasks.mix(), seed=cfg.run.seed, exclude=self.held_out)
        self.trainer = GRPOTrainer(self.policy, cfg.grpo, cfg.generation.max_new_tokens, cfg.run.rounds, cfg.generation.stop)
        self.probe_tasks = self.eval_tasks[:cfg.run.probe_tasks]  # a random subset: the set is drawn at random
        self.probe_rounds = probe_rounds(cfg.run.eval_every, cfg.run.rounds) if cfg.run.probe_tasks else []
        self.watch = LearningWatch(cfg.generation.max_new_tokens, cfg.grpo.lr, families(self.eval_tasks),
                                   families(self.probe_tasks), cfg.grpo.target_kl)
        self.round = 0
        self.pending_row: RoundMetrics | None = None  # a round whose evaluation a stop interrupted (`_pending_evaluation`)
        self.selector = Selector(cfg.selection, cfg.tasks, logprobs=self.trainer.sequence_logprobs,
                                 fits=self.trainer.fits if cfg.grpo.mask_truncated else None,
                                 floor=cfg.grpo.external_min_logprob, held_out=self.held_out)
        self.pool = RolloutPool(cfg.p2p.pool, proven=self.selector.proven)
        self.gossip: Gossip | None = None
        self._pool_accepted = 0
        self.board = StatusBoard("trainer", {"model": cfg.model.name, "plan": self.plan.summary(), "rounds": cfg.run.rounds, "peer_id": None,
                                             "network": cfg.p2p.network if cfg.p2p.enabled else None},
                                 cfg.status.history, live=self._live_p2p, stall_after_s=cfg.status.stall_after_s)
        if resumed:
            self._restore(resumed)
        else:  # lines of an earlier start that left no checkpoint: this run writes those rounds again
            self.metrics.rewind(-1)
        (out / "config.json").write_text(cfg.model_dump_json(indent=2))
        (out / "plan.json").write_text(json.dumps(self.plan.record(), indent=2))
        (out / "settings.json").write_text(json.dumps(fitted.settled.record(), indent=2))
        (out / "held_out.json").write_text(json.dumps(self.held_out.record(), indent=2))

    def _restore(self, ckpt: checkpoint.Checkpoint) -> None:
        self.round = ckpt.round
        self.tasks.position = ckpt.state["task_position"]
        self.trainer.optimizer.load_state_dict(ckpt.trainer_state["optimizer"])
        self.trainer.scheduler.load_state_dict(ckpt.trainer_state["scheduler"])
        torch.set_rng_state(ckpt.trainer_state["torch_rng"])
        if self.trainer.step_size is not None and "step_size" in ckpt.trainer_state:
            self.trainer.step_size.load_state_dict(ckpt.trainer_state["step_size"])
        self.generator.weight_version = ckpt.state["weight_version"]
        if "selection" in ckpt.state:
            self.selector.load_state_dict(ckpt.state["selection"])
        if ckpt.state.get("pending_row"):  # its line is written once evaluated (an earlier such line goes aside)
            known = RoundMetrics.__dataclass_fields__
            self.pending_row = RoundMetrics(**{k: v for k, v in ckpt.state["pending_row"].items() if k in known})
        self.metrics.rewind(ckpt.round - (self.pending_row is not None))
        self._resume_lr(ckpt.path)
        log.info("resumed from %s at round %d", ckpt.path, ckpt.round)
        if ckpt.round >= self.cfg.run.rounds and self.pending_row is None:
            log.warning("run.rounds is %d and this run folder has run %d: nothing left to run (raise --rounds to go on)",
                        self.cfg.run.rounds, ckpt.round)

    def save_checkpoint(self) -> None:
        trainer_state = {
            "optimizer": self.trainer.optimizer.state_dict(),
            "scheduler": self.trainer.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }
        if self.trainer.step_size is not None:
            trainer_state["step_size"] = self.trainer.step_size.state_dict()
        state = {"model": self.cfg.model.name, "lora": self.cfg.model.lora.enabled, "task_position": self.tasks.position,
                 "weight_version": self.generator.weight_version, "selection": self.selector.state_dict(),
                 "pending_row": asdict(self.pending_row) if self.pending_row else None}
        checkpoint.save(self.checkpoints, self.round, self.policy.model, self.policy.tokenizer, trainer_state, state,
                        keep=self.cfg.run.keep_checkpoints)

    def evaluate(self, cancel: Cancel = never) -> Evaluation:
        """Greedy accuracy on the held-out set, overall and per dataset; with `tasks.eval_samples` k, the expected
        accuracy too, from k completions a task sampled as the rounds sample (seeded alike at every evaluation, so
        that two evaluations differ by the model, not by the draw)."""
        gen, k = self.cfg.generation, self.cfg.tasks.eval_samples
        log.info("evaluating the weights of round %d on %d held-out tasks (%d completion(s) each)", self.round,
                 len(self.eval_tasks), 1 + k)
        greedy = evaluate(self.generator, self.policy, self.eval_tasks, gen.max_new_tokens, gen.stop, cancel)
        if not k:
            return Evaluation(accuracy(greedy), accuracy_by_dataset(greedy))
        params = replace(SamplingParams.from_config(gen, seed=self.cfg.tasks.eval_seed), n=k)
        sampled = rollout(self.generator, self.policy, self.eval_tasks, params, cancel=cancel)
        return Evaluation(accuracy(greedy), accuracy_by_dataset(greedy), accuracy(sampled), accuracy_by_dataset(sampled))

    def probe(self, cancel: Cancel = never) -> Evaluation:
        """Greedy accuracy on the early probe's tasks (`run.probe_tasks` of the held-out set), overall and per dataset."""
        gen = self.cfg.generation
        greedy = evaluate(self.generator, self.policy, self.probe_tasks, gen.max_new_tokens, gen.stop, cancel)
        return Evaluation(accuracy(greedy), accuracy_by_dataset(greedy))

    def run(self, stop: StopSignal) -> None:
        """Serve status, join the swarm (unless p2p is off) and run rounds until done or asked to stop.

        A component that keeps failing ends the run here: with a checkpoint when the node stands at a
        round boundary, and `ComponentFailed` for the caller to report. A node resumed at its last round
        neither serves nor joins: `sapo swarm` reads a bootstrap node that never listens as one with nothing left.
        """
        if self.round >= self.cfg.run.rounds and self.pending_row is None:
            return
        with contextlib.ExitStack() as stack:
            self._stack = stack
            stack.callback(self.selector.close)
            if self.cfg.selection.external_groups:
                self.selector.untrusted.start()  # its worker warms up while the node starts
            if self.cfg.status.enabled:
                stack.enter_context(StatusServer(self.cfg.status, self.board, self._status_socket))
            if self.cfg.p2p.enabled:
                self.gossip = stack.enter_context(self._new_gossip())
                self.board.update_info(peer_id=self.gossip.peer_id)
                if self.round == 0 and self.cfg.run.wait_for_peers:
                    self.board.set_state("waiting for peers")
                    self._wait_for_peers(stop, self.cfg.run.wait_for_peers)
            self.board.set_state("running")
            try:
                self._run_rounds(stop)
            except ComponentFailed as e:
                self.board.set_state("failed", str(e))
                if e.resumable:
                    self.save_checkpoint()
                raise
            self.board.set_state("stopped" if stop.requested else "done")

    def _wait_for_peers(self, stop: StopSignal, want: int, timeout: float = PEER_WAIT_S) -> None:
        """Connected to `want` peers and meshed with enough of them that the first publish reaches someone."""
        log.info("waiting up to %.0f s for %d peer(s)", timeout, want)
        mesh_want = min(want, self.cfg.p2p.mesh_low())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stop.requested:
            s = self.gossip.stats()
            if s["peers"] >= want and s["mesh_peers"] >= mesh_want:
                break
            time.sleep(0.2)
        peers = self.gossip.stats()["peers"]
        log.log(logging.INFO if peers >= want else logging.WARNING, "starting with %d of %d peer(s)", peers, want)

    def _run_rounds(self, stop: StopSignal) -> None:
        cfg, pending = self.cfg, self.pending_row is not None
        if self.threads is not None:
            self.threads.settle()  # before the first evaluation, as long as a few rounds on a real model
        if self.round == 0:
            if not self._measure_start(stop):  # stopped before it finished: the next start begins here again
                return
        else:
            self._watch_from(self.metrics.start_row() or {})
            if pending and not self._pending_evaluation(stop):
                return
        self.memory.start()  # its first window is a round's: not the loading, nor the first evaluation
        if self.threads is not None:
            self.threads.start()
        saved_round = -1 if pending else self.round  # the checkpoint still holds the line now written
        while self.round < cfg.run.rounds and not stop.requested:
            if self.gossip is not None and not self.gossip.alive:
                self._restart_gossip(stop)
            if self._one_round(stop) and self.round % cfg.run.checkpoint_every == 0:
                self.save_checkpoint()
                saved_round = self.round
        if self.round != saved_round or not checkpoint.complete(self.checkpoints):
            self.save_checkpoint()

    def _one_round(self, stop: StopSignal) -> bool:
        """One round, top to bottom; False if a stop request made it abandon the round before training.
        (The caller checkpoints every `run.checkpoint_every` rounds.)"""
        cfg, r = self.cfg, self.round + 1
        started, position, skipped, gc_s = time.perf_counter(), self.tasks.position, self.tasks.skipped, collector.seconds()
        # 1. take peers' groups from the pool: re-scored by our own verifier, selected by the sampling rule
        pick = self.selector.external(self.pool, random.Random(round_seed(cfg.run.seed, r)), r)
        slots, feed = self._local_slots(len(pick.groups))
        # 2. generate and score our own groups
        t0 = time.perf_counter()
        peer_tasks = self.selector.peer_tasks(slots - cfg.run.local_groups)  # empty unless when_short = peer_tasks
        tasks = peer_tasks + self.tasks.draw(self.selector.local_tasks(slots) + feed - len(peer_tasks))
        sampled = self._generate(r, tasks, stop, position)
        seconds = {"generate": time.perf_counter() - t0}
        if sampled is None:
            return False
        pick.peer_tasks = self.selector.took_peer_tasks(peer_tasks)
        # 3. publish them to the swarm (and feed our extra groups to our own pool when asked to)
        groups, published = self._share(r, sampled, feed)
        # 4. one GRPO step on local + external groups, then the new weights into the generator
        t0 = time.perf_counter()
        batch = self.selector.local(groups, slots) + pick.groups
        stats, seconds["push"] = self._train(r, batch)
        seconds["train"] = time.perf_counter() - t0
        self.selector.observe_own(stats.local_logprobs, groups, r)
        self.round = r
        # 5. the next round's micro-batch from this one's memory peak, evaluation (or the early probe) when due, the
        # metrics row (its measured fields filled in by `_close_round`)
        micro_batch, memory_peak = self._fit_micro_batch(stats)
        threads = torch.get_num_threads()  # this round's; the governor sets the next round's
        if self.threads is not None:
            self.threads.after_round()
        evaluation = self._measure(r, stop)
        seconds["other"] = time.perf_counter() - started - seconds["generate"] - seconds["train"]
        row = replace(self._round_metrics(r, sampled, groups, batch, pick, stats, seconds, Evaluation(), published,
                                          micro_batch, memory_peak), n_held_out_skipped=self.tasks.skipped - skipped,
                      torch_threads=threads, seconds_gc=collector.seconds() - gc_s)
        self.watch.observe(groups)  # says when a task family teaches nothing
        self._close_round(row, evaluation)
        return True

    def _close_round(self, row: RoundMetrics, evaluation: Evaluation | None) -> None:
        """The round's line. When a stop came mid-evaluation (None) the checkpoint keeps it instead, until a resume
        has evaluated the same weights (`_pending_evaluation`): no line is written twice, none without its evaluation."""
        if evaluation is None:
            self.pending_row = row
            return
        probing = row.round in self.probe_rounds
        row = replace(row, **(probe_fields(evaluation) if probing else evaluation.row_fields()))
        self._record(row)
        if probing:
            self.watch.probed(row.round, evaluation)
        else:
            self._watch_evaluation(row.round, evaluation)

    def _pending_evaluation(self, stop: StopSignal) -> bool:
        """The evaluation (or probe) a stop interrupted, of the weights the checkpoint holds: what an uninterrupted
        run would have measured. False if a stop interrupts it again."""
        row = self.pending_row
        evaluation = self._measure(row.round, stop)
        if evaluation is not None:
            self.pending_row = None
            log.info("round %d evaluated after the resume", row.round)
            self._close_round(row, evaluation)
        return evaluation is not None

    def _measure(self, r: int, stop: StopSignal) -> Evaluation | None:
        """Round `r`'s held-out measurement: the evaluation every run.eval_every rounds and at the last, the early
        probe in its rounds (`probe_rounds`: none of those), else none; None when a stop came during it."""
        if r % self.cfg.run.eval_every == 0 or r == self.cfg.run.rounds:
            return self._evaluate(stop)
        return self._evaluate(stop, self.probe) if r in self.probe_rounds else Evaluation()

    def _measure_start(self, stop: StopSignal) -> bool:
        """Round 0's line: the starting evaluation and the early probe's start, its tasks measured on their own as at
        its later rounds (greedy decoding is not bit-for-bit the same in another batch) unless they are the whole
        set. False if a stop came first."""
        evaluation = self._starting_evaluation(stop)
        if evaluation is None:
            return False
        if not self.probe_rounds:
            probe = Evaluation()
        elif len(self.probe_tasks) == len(self.eval_tasks):
            probe = Evaluation(evaluation.accuracy, evaluation.by_dataset)
        else:
            probe = self._evaluate(stop, self.probe)
        if probe is None:
            return False
        self._record(RoundMetrics(round=0, time=time.time(), reward_mean=None, accuracy_train=None,
                                  n_local=0, n_external=0, tokens_generated=0, seconds_generate=0.0, seconds_train=0.0,
                                  seconds_other=0.0, **evaluation.row_fields(), **probe_fields(probe)))
        self.watch.evaluated(0, evaluation)
        self.watch.probed(0, probe)
        return True

    def _watch_from(self, start: dict) -> None:
        """A resumed node's learning watch measures against round 0's line (`start`), as the uninterrupted run did."""
        self.watch.evaluated(0, Evaluation(start.get("eval_accuracy"), start.get("eval_by_dataset")))
        self.watch.probed(0, Evaluation(start.get("probe_accuracy"), start.get("probe_by_dataset")))

    def _watch_evaluation(self, r: int, evaluation: Evaluation) -> None:
        """Say when the model unlearns (stopping there, with no checkpoint of these weights, under
        run.stop_on_collapse)."""
        try:
            self.watch.evaluated(r, evaluation)
        except Collapsed as e:
            if not self.cfg.run.stop_on_collapse:
                log.warning("%s; training on (run.stop_on_collapse true stops here, before a checkpoint of these weights)", e)
                return
            raise ComponentFailed(str(e), resumable=False) from None

    def _resume_lr(self, path) -> None:
        """A resume trains at this config's grpo.lr (the optimizer's and scheduler's saved state would keep the one it
        started with), times the step-size controller's restored factor."""
        sched, lr = self.trainer.scheduler, self.cfg.grpo.lr
        if sched.base_lrs[0] != lr:
            log.warning("grpo.lr is %g; %s trained at %g: going on at %g", lr, path, sched.base_lrs[0], lr)
            sched.base_lrs = [lr] * len(sched.base_lrs)
        refresh_lr(sched)
        if self.trainer.step_size is not None:
            log.info("the step-size controller goes on at %g (%.3g x grpo.lr)", sched.get_last_lr()[0],
                     self.trainer.step_size.scale)

    def _local_slots(self, external: int) -> tuple[int, int]:
        """Local groups to train on (external slots left empty go to local ones under `fill_local`), and how
        many extra groups to sample for our own pool (`self_external`)."""
        sel = self.cfg.selection
        short = sel.external_groups - external if sel.when_short != "fewer" else 0
        return self.cfg.run.local_groups + short, sel.external_groups if sel.self_external else 0

    def _share(self, r: int, sampled: list[RolloutGroup], feed: int) -> tuple[list[RolloutGroup], int]:
        """The round's own groups, published; the last `feed` sampled go to our own pool instead."""
        groups, fed = sampled[: len(sampled) - feed], sampled[len(sampled) - feed:]
        for msg in self_messages(self.cfg.model.name, r, fed, self.cfg.p2p.limits):
            self.pool.add(msg)
        published = publish_round(self.gossip, self.cfg.model.name, r, groups, self.cfg.p2p.limits) if self.gossip else 0
        return groups, published

    def _fit_micro_batch(self, stats: StepStats) -> tuple[int, float | None]:
        """The micro-batch this round used and its memory peak; the next round's micro-batch is lowered when
        the peak came close to the plan's limit."""
        used = self.trainer.cfg.micro_batch
        peak, lower = self.memory.after_round(used, stats.longest_completion, stats.largest_part)
        self.trainer.cfg = self.trainer.cfg.model_copy(update={"micro_batch": lower})
        return used, peak

    def _round_metrics(self, r: int, sampled: list[RolloutGroup], groups: list[RolloutGroup], batch: list[RolloutGroup],
                       pick, stats: StepStats, seconds: dict[str, float], evaluation: Evaluation, published: int,
                       micro_batch: int, memory_peak: float | None) -> RoundMetrics:
        """The round's row. `groups`: the round's own (the primary reward counts only these); `batch`: what the step
        was given, local and external (the paper's reward counts these)."""
        return RoundMetrics(
            round=r, time=time.time(), reward_mean=mean_reward(groups), accuracy_train=accuracy(groups),
            batch_reward_mean=mean_reward(batch), **evaluation.row_fields(),
            n_local=len(groups), n_external=len(pick.groups), n_peer_tasks=pick.peer_tasks,
            tokens_generated=sum(len(ids) for g in sampled for ids in g.completion_ids or []),
            seconds_generate=seconds["generate"], seconds_train=seconds["train"], seconds_other=seconds["other"],
            seconds_push=seconds["push"], groups_trained=stats.groups_used, groups_dropped_uniform=stats.groups_dropped_uniform,
            local_informative=sum(map(informative, groups)), external_inspected=pick.inspected,
            external_informative=pick.informative, **stats.optimizer_metrics(),
            weight_version=self.generator.weight_version,
            n_external_used=stats.external_groups_used, external_masked=stats.external_masked,
            external_gated=pick.gated, external_shaped=stats.external_shaped, external_held_back=pick.held_back,
            seconds_gate=pick.gate_s,
            support_cutoff=self.selector.support.cutoff(),
            external_reward_mean=mean_reward(pick.groups),
            external_peers=len({g.source for g in pick.groups}), external_dropped=dict(pick.dropped),
            external_sources=dict(Counter(g.source for g in pick.groups)),
            external_families=dict(Counter(g.task.ref.dataset for g in pick.groups)),
            groups_published=published, micro_batch=micro_batch,
            memory_peak_gb=None if memory_peak is None else memory_peak / GB, **self._swarm_metrics(),
        )

    def _generate(self, r: int, tasks: list, stop: StopSignal, position: int) -> list[RolloutGroup] | None:
        """Sample and score the round's local groups; None (tasks put back) if a stop request came first."""
        cfg = self.cfg
        params = SamplingParams.from_config(cfg.generation, seed=round_seed(cfg.run.seed, r))
        try:
            groups = self._retrying("generation", lambda: rollout(self.generator, self.policy, tasks, params,
                                                                  cfg.tasks.format_weight, lambda: stop.requested), stop)
        except ComponentFailed:
            self.tasks.position = position  # the failed round is drawn again after a restart
            raise
        if groups is None or stop.requested:
            self.tasks.position = position  # the abandoned round is drawn again after a restart
            return None
        return groups

    def _train(self, r: int, groups: list[RolloutGroup]) -> tuple[StepStats, float]:
        """One GRPO step, then the new weights into the generator; the step's stats and the push's seconds."""
        self.generator.release()
        if self.memory.giving_back:  # past its plan once: sampling's memory, before the step allocates its own
            allocator.give_back_freed_memory()
        try:
            stats = self.trainer.step(groups)
        except Exception as e:  # noqa: BLE001 - a step may have half-applied: stop without a checkpoint of it
            raise ComponentFailed(f"training step of round {r} failed: {describe(e)}", resumable=False) from e
        if stats.optimizer_steps and not finite_weights(self.policy.model):  # a checkpoint of them would never resume
            raise ComponentFailed(f"the training step of round {r} left non-finite weights (grpo.lr {self.cfg.grpo.lr:g} "
                                  "too high?)", resumable=False)
        started = time.perf_counter()
        if stats.optimizer_steps:
            self.generator.set_weights(self.policy.model)
        return stats, time.perf_counter() - started

    def _restart_gossip(self, stop: StopSignal) -> None:
        """The p2p thread ended under us: start a new one with the same identity (the pool is kept)."""
        log.error("p2p layer stopped; restarting it")
        gossip = self._retrying("p2p layer", lambda: self._new_gossip().start(), stop)
        if gossip is not None:
            self._stack.callback(gossip.stop)
            self.gossip = gossip

    def _new_gossip(self) -> Gossip:
        """The p2p layer, with this node's identity, feeding the pool."""
        return Gossip(self.cfg.p2p, self.cfg.key_file(), self.pool.add, signal=group_carries_signal,
                      useful=self.selector.proven)

    def _retrying(self, what: str, fn, stop: StopSignal):
        return retrying(what, fn, self.cfg.run.retries, self.cfg.run.retry_backoff_s, stop)

    def _evaluate(self, stop: StopSignal, measure: Callable[[Cancel], Evaluation] | None = None) -> Evaluation | None:
        """Evaluation (`measure`: `evaluate` unless told) is a measurement, not progress: when it keeps failing the
        round goes on without it. None: a stop came first (the evaluation gives up within a decoding step)."""
        measure = measure or self.evaluate
        try:
            return self._retrying("evaluation", lambda: measure(lambda: stop.requested), stop)
        except ComponentFailed as e:
            log.error("%s; this evaluation is skipped", e)
            return Evaluation()
        finally:  # what its many rows freed (trainer/allocator.py), once per evaluation: a round's sampling reuses less
            allocator.give_back_freed_memory()

    def _starting_evaluation(self, stop: StopSignal) -> Evaluation | None:
        """Round 0's evaluation, from `run.eval_cache_dir` when a run of the same model already measured it."""
        if self.cfg.run.eval_cache_dir is None:
            return self._evaluate(stop)
        cache = EvalCache(self.cfg.run.eval_cache_dir)
        key = evaluation_key(self.policy, self.generator, self.eval_tasks,
                             {"generation": self.cfg.generation.model_dump(mode="json"), "k": self.cfg.tasks.eval_samples})
        evaluation = cache.get(key)
        if evaluation is None:
            evaluation = self._evaluate(stop)
            if evaluation is not None and evaluation.accuracy is not None:  # a skipped evaluation is not a measurement
                cache.put(key, evaluation)
        return evaluation

    def _live_p2p(self) -> dict:
        """Current gossip and pool counters, for the status endpoint."""
        if self.gossip is None:
            return {}
        return {**self.gossip.stats(), "pool": self.pool.stats()}

    def _swarm_metrics(self) -> dict:
        """This round's share of the live counters: peers, groups received, and the cumulative counters."""
        live = self._live_p2p()
        if not live:
            return {}
        accepted = live["pool"]["accepted"]
        received, self._pool_accepted = accepted - self._pool_accepted, accepted
        return {"peers": live.pop("peers"), "n_external_received": received,
                "p2p": {k: v for k, v in live.items() if k != "peer_id"}}

    def _record(self, m: RoundMetrics) -> None:
        self.metrics.append(m)
        self.board.record(asdict(m))
        self.progress.round(m)
        log.debug("round %d: %s", m.round, json.dumps(m.__dict__))
