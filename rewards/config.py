"""Which tasks a node trains and evaluates on."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from rewards.mixes import MIXES, expand
from rewards.source import DatasetMix
from rewards.datasets import canonical_config, check_dataset
from rewards.tasks import TaskError


class DatasetSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(description="built-in (arith, reverse, count) or reasoning-gym as 'rg/<name>'")
    config: dict[str, Any] = Field(default_factory=dict, description="the dataset's difficulty knobs")
    weight: float = Field(1.0, gt=0, description="relative share of draws")

    @model_validator(mode="after")
    def _regenerates(self) -> "DatasetSpec":
        try:
            check_dataset(self.name, self.config)
        except TaskError as e:
            raise ValueError(str(e)) from None
        return self

    def mix(self) -> DatasetMix:
        return DatasetMix(self.name, self.config, self.weight)


class TasksConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    datasets: Annotated[list[DatasetSpec], NoDecode] = Field(  # SAPO_TASKS__DATASETS=arith,reverse:2 reaches the validator as text
        default_factory=lambda: [DatasetSpec(name=n) for n in ("arith", "reverse", "count")],
        min_length=1,
        description="weighted task mix; on the command line also 'arith,reverse:2,rg/leg_counting', where a mix's "
        f"name ({', '.join(MIXES)}) stands for its datasets",
    )
    eval_datasets: Annotated[list[DatasetSpec] | None, NoDecode] = Field(
        None, min_length=1,
        description="the evaluation's task mix, in the same forms as datasets (default: the training mix): families a node "
        "does not train on, to see what it learns from peers, or the training mix less families that saturate")
    eval_size: int = Field(200, ge=1, description="held-out tasks in the fixed evaluation set; the node never "
                           "trains on their questions, drawn or from a peer (unless a family is too small to hold out)")
    eval_samples: int = Field(0, ge=0, le=64, description="completions per held-out task at the sampling temperature for "
                              "the expected accuracy (their mean), reported beside the greedy accuracy; 0: greedy only. "
                              "k samples tell apart smaller changes than one greedy answer, at k times the evaluation's cost")
    eval_seed: int = Field(7, description="seed of the evaluation set (keep it apart from run.seed)")
    format_weight: float = Field(0.0, ge=0, description="extra reward for a well-formed <answer> block")

    @field_validator("datasets", "eval_datasets", mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        """'arith,reverse:2' -> [{'name': 'arith'}, {'name': 'reverse', 'weight': 2}]; a JSON list is read as one."""
        if not isinstance(value, str):
            return value
        if value.lstrip().startswith(("[", "{")):  # JSON; an object is then refused as not a list
            try:
                return json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON ({e.msg})") from None
        specs = []
        for part in filter(None, (p.strip() for p in value.split(","))):
            name, _, weight = part.partition(":")
            try:
                mix = expand(name, float(weight or 1))
            except ValueError:
                mix = None  # a weight that is not a number: the dataset's own check names it
            specs += mix if mix is not None else [{"name": name, **({"weight": weight} if weight else {})}]
        return specs

    def mix(self) -> list[DatasetMix]:
        return [d.mix() for d in self.datasets]

    def eval_mix(self) -> list[DatasetMix]:
        """What the held-out set is drawn from: `eval_datasets`, else the training mix."""
        return [d.mix() for d in self.eval_datasets or self.datasets]

    def has(self, dataset: str, config: dict[str, Any]) -> bool:
        """Whether this node draws tasks of this dataset with this config (defaults written out or not)."""
        own = [d for d in self.datasets if d.name == dataset]
        if not own:
            return False
        theirs = canonical_config(dataset, config)
        return any(canonical_config(d.name, d.config) == theirs for d in own)
