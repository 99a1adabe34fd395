"""One GRPO update per round: the whole training step reads top to bottom in `GRPOTrainer.step`.

External rollouts (text other peers generated) are off-policy, and the sampling policy, another
model with another tokenizer, cannot be evaluated here. So every row, local or external, takes this
node's own pre-update log-probs as the old policy: the ratio starts at 1 and the clip (and dual
clip) bound how far one round moves on any sample. External completions that this policy would
almost never write (mean token log-prob below `external_min_logprob`) are masked out: their
gradient mostly teaches another model's habits, with high variance and no importance weight to
temper it. External completions that scored below their group's mean are masked too, unless
`external_negatives` is on: a peer's mistakes are sequences this policy did not write, and pushing
them down spends the step on text it rarely produces; what a peer got right is what it can learn.
"""

from __future__ import annotations

import copy
import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from trainer.attention import use_cpu_attention
from trainer.batch import Batch, collate, token_logprobs
from trainer.groups import RolloutGroup
from trainer.config import GRPOConfig
from trainer.loss import group_advantages, grpo_loss, loss_count
from trainer.policy import Policy, encode_prompts
from trainer.precision import bfloat16_or_own
from trainer.step_size import StepSize

log = logging.getLogger(__name__)

FUSED_ADAMW = ("cpu", "cuda")  # devices whose fused AdamW kernel the trainer uses (on CUDA torch's own advice; unmeasured here)


@dataclass
class StepStats:
    groups_used: int
    groups_dropped_uniform: int
    sequences: int
    optimizer_steps: int
    loss: float = 0.0
    ratio_mean: float = 1.0
    clip_frac: float = 0.0
    kl: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0
    step_kl: float | None = None  # mean per-token KL between the policy before and after the step (grpo.target_kl)
    lr_next: float = 0.0  # the rate the next step takes, after the step-size controller
    external_groups_used: int = 0
    external_masked: int = 0  # external completions masked as off-support
    external_shaped: int = 0  # external completions trained with the policy-shaped weight (rule `scoped`)
    local_logprobs: list[float] = field(default_factory=list)  # mean token log-prob of each local row, pre-update
    # what the round's memory peak is compared with the plan at: the longest completion in tokens, and the micro-
    # batch that ran the most positions (positions, rows), what the step's activations are made of
    longest_completion: int = 0
    largest_part: tuple[int, int] = (0, 0)

    def optimizer_metrics(self) -> dict[str, float | None]:
        """Loss, KL, clip fraction, gradient norm and learning rate; None when no optimizer step was taken (a
        round with nothing to learn from), so a zero is never mistaken for a measurement."""
        trained = self.optimizer_steps > 0
        return {k: getattr(self, k) if trained else None
                for k in ("loss", "kl", "clip_frac", "grad_norm", "lr", "step_kl", "lr_next")}


def make_scheduler(opt: torch.optim.Optimizer, cfg: GRPOConfig, total_steps: int,
                   scale: Callable[[], float] = lambda: 1.0) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup and decay of grpo.lr, times `scale()`: the step-size controller's factor (trainer/step_size.py)."""
    def factor(step: int) -> float:
        return schedule(step) * scale()

    def schedule(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        if cfg.lr_schedule == "linear":
            return 1.0 - progress
        if cfg.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def merge_stats(parts: list[dict[str, float]], count: float) -> dict[str, float]:
    """One minibatch's statistics from its micro-batches': summed losses over the count, token means re-weighted."""
    tokens = sum(p["tokens"] for p in parts)
    merged = {k: sum(p[k] * p["tokens"] for p in parts) / max(tokens, 1) for k in ("ratio_mean", "clip_frac", "kl")}
    return {**merged, "loss": sum(p["loss"] for p in parts) / count}


class GRPOTrainer:
    def __init__(self, policy: Policy, cfg: GRPOConfig, max_new_tokens: int, total_rounds: int, stop: Sequence[str] = ()):
        self.policy, self.cfg, self.max_tokens, self.stop = policy, cfg, max_new_tokens, tuple(stop)
        self.params = [p for p in policy.model.parameters() if p.requires_grad]
        if policy.device.type == "cpu":
            use_cpu_attention(policy.model)  # float32 SDPA with shared heads: the CPU kernel's fast case (trainer/attention.py)
        # every forward of the step, its old-policy and reference passes included, in one compute dtype: the ratio
        # starts at 1 whichever it is
        self.compute_dtype = bfloat16_or_own(cfg.compute_dtype, policy)
        if self.compute_dtype is not None:
            log.info("training: the step's matrix products autocast to %s (grpo.compute_dtype %s)",
                     str(self.compute_dtype).removeprefix("torch."), cfg.compute_dtype)
        # torch's fused AdamW: one kernel over every tensor where the device has one, 0.07 s a step for SmolLM2-135M on 2
        # CPU cores against 0.2-0.4 s for the per-tensor and foreach loops (docs/bench/speed.md, "Training with bfloat16
        # products on the CPU")
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay,
                                           fused=True if policy.device.type in FUSED_ADAMW else None)
        self.step_size = StepSize(cfg.target_kl, *cfg.lr_range) if cfg.target_kl else None
        self.scheduler = make_scheduler(self.optimizer, cfg, total_rounds * cfg.epochs * cfg.minibatches,
                                        lambda: self.step_size.scale if self.step_size else 1.0)
        # Gradient checkpointing drops the KV cache that a shared prompt passes on (see token_logprobs).
        self.share_prompts = not any(getattr(m, "gradient_checkpointing", False) for m in policy.model.modules())
        # The KL reference: with LoRA the base under the adapters (`disable_adapter`), no copy; else a frozen copy.
        self.reference = None
        if cfg.kl_coef > 0 and not hasattr(policy.model, "disable_adapter"):
            self.reference = copy.deepcopy(policy.model).eval().requires_grad_(False)

    def step(self, groups: list[RolloutGroup]) -> StepStats:
        cfg, model = self.cfg, self.policy.model
        kept = [g for g in groups if not (cfg.drop_uniform_groups and len(set(g.rewards)) == 1)]
        stats = StepStats(groups_used=len(kept), groups_dropped_uniform=len(groups) - len(kept), sequences=0,
                          optimizer_steps=0, external_groups_used=sum(g.source != "local" for g in kept))
        if not kept:
            return stats

        batch, rewards, group_ids, truncated, external, used, shaped = self._tensors(kept)
        stats.longest_completion = batch.completion_mask.shape[1]
        advantages = group_advantages(rewards, group_ids, cfg.advantage_scale)
        loss_mask = batch.completion_mask * (used & ~truncated if cfg.mask_truncated else used)[:, None]
        if not cfg.external_negatives:  # learn from peers' successes only
            loss_mask = loss_mask * ~(external & (advantages < 0))[:, None]
        # The "old" policy of every epoch is the model before this round's update. With one pass over
        # the batch that is the model of the pass itself: its own log-probs, detached, save a forward.
        one_pass = cfg.epochs == cfg.minibatches == 1
        with torch.no_grad():
            old_logps = None if one_pass else self._logprobs(model, batch)
            ref_logps = self._reference_logprobs(batch) if cfg.kl_coef > 0 else None
        off_support = torch.zeros_like(external)
        sequence_logps = torch.zeros_like(rewards)
        probe = self._kl_probe(batch, external)  # before the update: (rows, their log-probs)

        model.train()
        n = len(rewards)
        history = []
        for _ in range(cfg.epochs):
            for rows in torch.randperm(n, device=rewards.device).chunk(cfg.minibatches):
                self.optimizer.zero_grad(set_to_none=True)
                parts = []
                for part in self._micro(rows, batch):  # gradients accumulate; memory is one micro-batch's
                    stats.largest_part = max(stats.largest_part, (self._tokens(part, batch), len(part)))
                    with self._autocast():
                        logps = token_logprobs(model, batch.select(part), self.share_prompts)
                    old = logps.detach() if old_logps is None else old_logps[part]
                    sequence_logps[part] = mean_logprobs(old, batch.completion_mask[part])
                    off_support[part] = external[part] & self._off_support(sequence_logps[part])
                    loss_mask[part] *= (~off_support[part])[:, None]
                    loss, part_info = grpo_loss(logps, old, advantages[part], loss_mask[part], cfg, self.max_tokens,
                                                None if ref_logps is None else ref_logps[part], count=1, shaped=shaped[part])
                    loss.backward()
                    parts.append(part_info)
                # The loss was summed over micro-batches; its denominator is known once every mask is.
                count = loss_count(loss_mask[rows], cfg.loss_aggregation, self.max_tokens)
                for p in self.params:
                    if p.grad is not None:
                        p.grad.div_(count)
                info = merge_stats(parts, float(count))
                info["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm).item()
                info["lr"] = self.scheduler.get_last_lr()[0]
                self.optimizer.step()
                self.scheduler.step()
                history.append(info)
        model.eval()
        if probe is not None:
            stats.step_kl = self._step_kl(*probe)
            self.step_size.update(stats.step_kl)
            refresh_lr(self.scheduler)
        stats.lr_next = self.scheduler.get_last_lr()[0]
        stats.external_masked = int(off_support.sum())
        stats.external_shaped = int((shaped & (loss_mask.sum(-1) > 0)).sum())
        stats.local_logprobs = sequence_logps[~external].tolist()

        stats.sequences, stats.optimizer_steps = n, len(history)
        for key in ("loss", "ratio_mean", "clip_frac", "kl", "grad_norm", "lr"):
            setattr(stats, key, sum(h[key] for h in history) / len(history))
        return stats

    @torch.no_grad()
    def _kl_probe(self, batch: Batch, external: torch.Tensor) -> tuple[Batch, torch.Tensor] | None:
        """Up to a micro-batch of the step's own local rows, spread over its groups, and their log-probs before the
        update, computed as `_step_kl` computes them after it (the step's own forward differs from a no-grad one by
        its rounding: in bfloat16 that alone measured a KL of 0.006 a token on SmolLM2). None when the controller is
        off or the step has no local rows."""
        local = (~external).nonzero().squeeze(-1)
        if self.step_size is None or not len(local):
            return None
        part = batch.select(local[torch.linspace(0, len(local) - 1, min(len(local), self.cfg.micro_batch or 8)).round().long()])
        return part, self._logprobs(self.policy.model, part)

    @torch.no_grad()
    def _step_kl(self, part: Batch, before: torch.Tensor) -> float:
        """KL(before || after) per token on the probe's rows (sampled by the policy before the step, at the round's
        temperature), k3-estimated: the mean of r - 1 - log r, r = pi_after / pi_before."""
        log_ratio = self._logprobs(self.policy.model, part) - before
        k3 = (log_ratio.exp() - 1 - log_ratio) * part.completion_mask
        return float(k3.sum() / part.completion_mask.sum().clamp(min=1))

    def _off_support(self, sequence_logps: torch.Tensor) -> torch.Tensor:
        """Rows whose mean token log-prob under the pre-update policy is below `external_min_logprob`."""
        if self.cfg.external_min_logprob is None:
            return torch.zeros(len(sequence_logps), dtype=torch.bool, device=sequence_logps.device)
        return sequence_logps < self.cfg.external_min_logprob

    def fits(self, texts: list[str]) -> list[bool]:
        """Whether each text from elsewhere fits this node's completion budget, tokenized as a step would: one
        that does not is cut and counts as truncated (masked from the loss under `mask_truncated`)."""
        return [not cut for cut in self._external_ids(texts)[1]]

    @torch.no_grad()
    def sequence_logprobs(self, groups: list[RolloutGroup]) -> list[list[float]]:
        """Each group's completions' mean token log-probs under the current policy, tokenized as a step would."""
        batch = self._tensors(groups)[0]
        flat = iter(mean_logprobs(self._logprobs(self.policy.model, batch), batch.completion_mask).tolist())
        return [[next(flat) for _ in g.completions] for g in groups]

    def _micro(self, rows: torch.Tensor, batch: Batch) -> list[torch.Tensor]:
        """`rows` in micro-batches of at most `micro_batch` rows that run the fewest positions.

        A micro-batch runs each of its distinct prompts once (when shared) and every row padded to its
        longest completion, so one long completion pads its group's short ones. The rows are put in two
        orders, by prompt then completion length (prompts run once per micro-batch) and by completion
        length alone (the least padding), and each order is cut where it costs least (a dynamic program
        over cut points: a long row ends up in a micro-batch of its own or with other long ones)."""
        size = self.cfg.micro_batch or len(rows)
        lengths = batch.completion_mask[rows].sum(-1).long()
        orders = [rows[(batch.prompt_index[rows] * (batch.completion_mask.shape[1] + 1) + lengths).argsort(stable=True)],
                  rows[lengths.argsort(stable=True)]]
        return min((self._cut(order, batch, size) for order in orders), key=lambda cut: cut[1])[0]

    def _cut(self, order: torch.Tensor, batch: Batch, size: int) -> tuple[list[torch.Tensor], float]:
        """`order` cut into consecutive parts of at most `size` rows running the fewest positions in all,
        and how many that is."""
        prompt_lens = batch.attention_mask[order, : batch.prompt_len].sum(-1).tolist()
        completion_lens = batch.completion_mask[order].sum(-1).long().tolist()
        prompts = batch.prompt_index[order].tolist()
        n = len(prompt_lens)
        best, cut = [0] + [math.inf] * n, [0] * (n + 1)  # best[i]: least cost of the first i rows; cut[i]: where its last part starts
        for i in range(1, n + 1):
            for j in range(max(0, i - size), i):
                longest_prompt, longest_completion = max(prompt_lens[j:i]), max(completion_lens[j:i])
                runs = len(set(prompts[j:i])) if self.share_prompts else i - j
                cost = best[j] + runs * longest_prompt + (i - j) * longest_completion
                if cost < best[i]:
                    best[i], cut[i] = cost, j
        bounds, i = [], n
        while i > 0:
            bounds.append((cut[i], i))
            i = cut[i]
        return [order[j:i] for j, i in reversed(bounds)], best[n]

    def _tokens(self, part: torch.Tensor, batch: Batch) -> int:
        """Positions a micro-batch's forward runs: its prompts (once each when shared) and its padded completions."""
        prompt = int(batch.attention_mask[part, : batch.prompt_len].sum(-1).max())
        completion = int(batch.completion_mask[part].sum(-1).max())
        prompts = len(batch.prompt_index[part].unique()) if self.share_prompts else len(part)
        return prompts * prompt + len(part) * completion

    def _logprobs(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        rows = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device)
        logps = torch.empty_like(batch.completion_mask)
        for part in self._micro(rows, batch):
            with self._autocast():
                logps[part] = token_logprobs(model, batch.select(part), share_prompts=True)  # no_grad: nothing checkpointed
        return logps

    def _autocast(self) -> torch.autocast:
        """The step's forwards in `grpo.compute_dtype` (trainer/precision.py); the backward follows what they recorded."""
        return torch.autocast(self.policy.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype is not None)

    def _reference_logprobs(self, batch: Batch) -> torch.Tensor:
        if self.reference is not None:
            return self._logprobs(self.reference, batch)
        with self.policy.model.disable_adapter():
            return self._logprobs(self.policy.model, batch)

    def _tensors(self, groups: list[RolloutGroup]) -> tuple[Batch, torch.Tensor, ...]:
        """Tokenize with this node's own tokenizer: text from peers is re-tokenized, local ids are reused.
        Returns the batch and per row: reward, group index, truncated, external, used, shaped."""
        device = self.policy.device
        prompt_ids = encode_prompts(self.policy, [g.task.prompt for g in groups])
        prompts, completions, rows = [], [], []
        for gi, g in enumerate(groups):
            ids, cut = (g.completion_ids, g.truncated) if g.completion_ids is not None else self._external_ids(g.completions)
            for c_ids, r, t, u, s in zip(ids, g.rewards, map(operator.or_, g.truncated, cut), g.used or [True] * len(ids),
                                         g.shaped or [False] * len(ids)):
                prompts.append(prompt_ids[gi])
                completions.append(c_ids)
                rows.append((r, gi, t, g.source != "local", u, s))
        batch = collate(prompts, completions, self.policy.tokenizer.pad_token_id, device)
        rewards, group_ids, truncated, external, used, shaped = zip(*rows)
        return (batch, torch.tensor(rewards, dtype=torch.float32, device=device),
                torch.tensor(group_ids, dtype=torch.long, device=device),
                *(torch.tensor(flags, dtype=torch.bool, device=device) for flags in (truncated, external, used, shaped)))

    def _external_ids(self, texts: list[str]) -> tuple[list[list[int]], list[bool]]:
        """Token ids of text that came from elsewhere, as this node's generator would have kept them.

        Text that does not end with a stop string ended with its author's end-of-sequence token: it
        gets this tokenizer's EOS, as this node's own samples keep theirs, so that the model learns
        where to stop from either. What then does not fit the budget is cut there and counts as
        truncated (a peer's cut completion cannot be told apart from one that runs past our budget)."""
        eos = self.policy.stop_token_ids[:1]
        out, truncated = [], []
        for text, ids in zip(texts, self.policy.tokenizer(texts, add_special_tokens=False)["input_ids"]):
            full = ids if self.stop and text.endswith(self.stop) else ids + eos
            out.append(full[: self.max_tokens])
            truncated.append(len(full) > self.max_tokens)
        return out, truncated


def refresh_lr(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Each group's rate from the scheduler's base rates and factor now: after the base rates or the step-size
    controller's factor changed between steps."""
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def mean_logprobs(token_logps: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Each row's mean token log-prob over its completion: how likely this policy finds the text, per token."""
    return (token_logps * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1)
