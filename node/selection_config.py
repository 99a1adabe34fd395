"""The selection knobs (`[selection]`), apart from the rules that use them (`node.selection`), so that
reading a config loads neither torch nor transformers: the CLI answers a bad flag before either is imported."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rewards import untrusted

# every reason a pool group taken by the round goes unused (metrics.jsonl external_dropped, /metrics)
DROP_REASONS = ("not_accepted", "uniform_rewards", "off_support", "too_long", "held_out", *untrusted.DROP_REASONS)

class SelectionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    external_groups: int = Field(4, ge=0, description="J: groups other peers shared, taken from the pool each round (0: silo)")
    rule: Literal["uniform", "signal", "guarded", "scoped", "adaptive"] = Field(
        "guarded", description="how external groups are chosen: uniform (any usable group), signal (only groups "
        "whose re-scored rewards differ), guarded (signal, counting only the rows this node would push up that pass "
        "its support gate), scoped (guarded, except that on a task family where a peer's re-scored pass rate beats "
        "this node's own its right rows below the gate are trained with a policy-shaped weight; a peer that wraps right "
        "answers in text of its own gets that text learned: not safe among strangers), adaptive (signal, "
        "inspecting first the peers whose groups carried signal before)")
    when_short: Literal["fill_local", "peer_tasks", "fewer"] = Field(
        "fill_local", description="when the pool yields fewer than J groups: draw local tasks for the rest; peer_tasks: "
        "first take the tasks of peers' groups that carried signal here but whose text could not be used (off the support "
        "gate, too long), sampled with this node's own model (on-policy, no foreign text, the same generation as "
        "fill_local), then local ones; or train on fewer")
    accept: Literal["own", "any"] = Field(
        "own", description="external tasks to consider: 'own' = same dataset and config as one of ours; "
        "'any' = every task this node can regenerate")
    max_inspect: int = Field(64, ge=1, description="most pool groups re-scored per round while looking for J informative ones")
    budget_s: float = Field(5.0, gt=0, description="most seconds a round spends regenerating and re-scoring pool groups; "
                            "an inspection starts only while it can finish within this")
    regen_timeout_s: float = Field(2.0, gt=0, description="deadline for regenerating and scoring one peer's task (its "
                                   "worker process is killed past it, and that dataset config refused from then on "
                                   "unless it is one of this node's own)")
    regen_memory_mb: int = Field(1024, ge=256, description="address-space cap of the worker process that regenerates "
                                 "peers' tasks")
    local_overdraw: float = Field(1.0, ge=1, le=8, description="sample this many times I local tasks and fill the I local "
                                  "slots with informative groups first (1: off; costs generation)")
    decay: float = Field(0.98, gt=0, lt=1, description="adaptive: per-round decay of what it learned about peers")
    explore: float = Field(0.1, ge=0, le=1, description="share of inspections given to groups of unproven peers (whose "
                           "groups have not carried signal here yet) while proven peers have groups, and at most "
                           "explore x max_inspect of them a round once any peer is proven, or once their peer has had 8 inspections "
                           "that found nothing; adaptive: also the share given to a uniformly random group")
    max_tracked: int = Field(4096, ge=1, description="adaptive: most peers it keeps statistics for")
    support_quantile: float = Field(0.05, gt=0, lt=1, description="guarded: an external completion is pushed up only if "
                                    "its mean token log-prob under this node is at least this quantile of the node's own "
                                    "recent completions'")
    support_window: int = Field(512, ge=8, description="guarded: own completions remembered for the support gate's cut-off")
    self_external: bool = Field(False, description="control experiment: fill the J slots with this node's own extra groups "
                                "of the previous round, sent through the external path (text, re-tokenized, re-scored)")

    @model_validator(mode="after")
    def _budget_fits_a_task(self) -> "SelectionConfig":
        if self.budget_s < self.regen_timeout_s:
            raise ValueError(f"budget_s ({self.budget_s:g}) must be at least regen_timeout_s ({self.regen_timeout_s:g})")
        return self


RULES: tuple[str, ...] = get_args(SelectionConfig.model_fields["rule"].annotation)  # for scripts' --rule flags
GATED = ("guarded", "scoped")  # the rules with a support gate
