"""The GRPO-family objective as pure functions of tensors, so each knob can be checked by hand."""

from __future__ import annotations

import torch

from trainer.config import GRPOConfig

EPS = 1e-6


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, scale: str) -> torch.Tensor:
    """Reward minus its group mean, divided by the group std ('group'), the batch std ('batch') or 1 ('none').

    Standard deviations are population ones (divide by n), so a group of two rewards 0 and 1 gets +-1.
    """
    adv = torch.empty_like(rewards)
    group_std = torch.empty_like(rewards)
    for g in group_ids.unique():
        rows = group_ids == g
        adv[rows] = rewards[rows] - rewards[rows].mean()
        group_std[rows] = rewards[rows].std(unbiased=False)
    if scale == "group":
        return adv / (group_std + EPS)
    if scale == "batch":
        return adv / (rewards.std(unbiased=False) + EPS)
    return adv


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, max_tokens: int,
              count: float | torch.Tensor | None = None) -> torch.Tensor:
    """Reduce (B, C) token losses to a scalar: DAPO 'token', GRPO 'sequence' or Dr. GRPO 'constant'.

    `count` replaces the denominator `loss_count(mask)`: a trainer that accumulates micro-batches
    passes 1 and divides the summed gradient by the minibatch's count once the minibatch's mask is final.
    """
    masked = per_token * mask
    if mode == "sequence":
        tokens = mask.sum(-1)
        has = tokens > 0
        total = (masked.sum(-1)[has] / tokens[has]).sum()
    else:
        total = masked.sum()
    return total / (loss_count(mask, mode, max_tokens) if count is None else count)


def loss_count(mask: torch.Tensor, mode: str, max_tokens: int) -> torch.Tensor:
    """The denominator of `aggregate`: masked tokens ('token'), sequences with any ('sequence') or B x max_tokens."""
    if mode == "token":
        return mask.sum().clamp(min=1)
    if mode == "sequence":
        return (mask.sum(-1) > 0).sum().clamp(min=1)
    return torch.tensor(float(mask.shape[0] * max_tokens))


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOConfig,
    max_tokens: int,
    ref_logps: torch.Tensor | None = None,
    count: float | None = None,
    shaped: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss over (B, C) token log-probs with per-sequence advantages (B,);
    `count` as in `aggregate`. Its statistics are token means, with the token count to merge them.
    Rows flagged in `shaped` (B,) take LUFFY's policy-shaped objective (Yan et al. 2025) in place of the
    clipped ratio: -A * f(pi), f(pi) = pi / (pi + gamma), unclipped. Its gradient is A * gamma * pi / (pi +
    gamma)^2 per unit of grad log pi: at most A / 4 (at pi = gamma), and about A * pi / gamma on a token
    this policy finds far less likely than gamma, so another model's habits move it little."""
    adv = advantages[:, None]
    ratio = torch.exp(logps - old_logps)
    clipped_ratio = ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)
    if cfg.dual_clip is not None:
        # For negative advantages the plain clip leaves the loss unbounded as the ratio grows:
        # cap it at dual_clip * |A| (Ye et al. 2020).
        per_token = torch.where(adv < 0, torch.minimum(per_token, -cfg.dual_clip * adv), per_token)
    if shaped is not None and bool(shaped.any()):
        pi = torch.exp(logps)
        per_token = torch.where(shaped[:, None], -adv * pi / (pi + cfg.shaping_gamma), per_token)
    kl = torch.zeros_like(per_token)
    if ref_logps is not None and cfg.kl_coef > 0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1  # k3 estimator: unbiased, always >= 0
        per_token = per_token + cfg.kl_coef * kl
    loss = aggregate(per_token, mask, cfg.loss_aggregation, max_tokens, count)
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        stats = {
            "loss": loss.item(),
            "ratio_mean": ((ratio * mask).sum() / n).item(),
            "clip_frac": ((((ratio < 1 - cfg.clip_eps_low) | (ratio > 1 + cfg.clip_eps_high)).float() * mask).sum() / n).item(),
            "kl": ((kl * mask).sum() / n).item(),
            "tokens": mask.sum().item(),
        }
    return loss, stats
