"""The one typed config of a node: defaults < file (TOML/YAML) < SAPO_* environment < CLI flags."""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import to_jsonable_python
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from node.selection_config import SelectionConfig
from node.status import StatusConfig
from p2p.config import P2PConfig
from p2p.config_errors import describe
from rewards.config import TasksConfig
from trainer.config import VLLM_LORA_RANKS, GenerationConfig, GRPOConfig, ModelConfig


class ConfigError(ValueError):
    """A config problem, worded for the user: names the field and what is wrong."""


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    out_dir: Path = Field(Path("runs/node"), description="metrics.jsonl, checkpoints/ and config.json go here")
    rounds: int = Field(600, ge=1, description="stop after this many rounds (a resumed run counts from its checkpoint)")
    local_groups: int = Field(4, ge=1, description="I: tasks drawn per round, each sampled G times")
    wait_for_peers: int = Field(0, ge=0, description="before round 1, wait up to 120 s for this many peers (for experiments that start nodes together)")
    torch_threads: int | None = Field(None, ge=1, description="CPU threads torch may use (null: the cores other work "
                                      "leaves free, chosen again after every round, at least one); `sapo swarm` sets "
                                      "each of its nodes' share")
    seed: int | None = Field(None, description="seeds task draws and sampling (null: with p2p on, a seed of the node's "
                             "key, so that nodes started alike draw their own tasks and samples and a restart the same "
                             "ones; with p2p off, 0)")
    memory_gb: float | None = Field(None, gt=0, description="the node's share (GB) of its device's memory (GPU or host), "
                                    "which it plans its rounds in: a config that cannot fit is refused at start; `sapo "
                                    "swarm` and the compose file give each node its share (null: a card's free memory; on "
                                    "a host a container's limit, else the memory available less 15% of the machine, at "
                                    "least 1 GB, for the rest of it)")
    eval_every: int = Field(25, ge=1, description="greedy evaluation on the held-out set every K rounds")
    eval_cache_dir: Path | None = Field(None, description="a folder where the starting model's evaluation is kept, keyed "
                                        "by its weights, evaluation prompts, answers, sampling and backend (not by the "
                                        "code): a run that starts from the same model reuses it, so an experiment's arms "
                                        "evaluate their shared base model once (null: every run evaluates it)")
    stop_on_collapse: bool = Field(False, description="stop, without a checkpoint of the weights, when held-out accuracy "
                                   "falls below half its start beyond the evaluation's noise (node/watch.py); off, the node "
                                   "warns at each such evaluation and trains on (a tiny model's dip can recover)")
    probe_tasks: int = Field(64, ge=0, description="the early probe: greedy accuracy on this many of the held-out tasks "
                             "at rounds 8, 16, 32, ... before the first evaluation (run.eval_every), against the same "
                             "tasks at round 0, so that a learning rate that destroys the model is said within its first "
                             "rounds (metrics: probe_accuracy, probe_by_dataset); it warns, never stops (0: off)")
    checkpoint_every: int = Field(100, ge=1, description="checkpoint every K rounds, and always on stop")
    keep_checkpoints: int = Field(3, ge=1, description="keep the newest K checkpoints")
    metrics_rotate_mb: float = Field(32.0, gt=0, description="past this size (MB) metrics.jsonl's lines move, gzip-compressed "
                                     "(about a tenth of the size), to metrics.<first>-<last>.jsonl.gz and the file starts "
                                     "again; nothing is deleted (a node that runs for days writes about 1.5 KB a round)")
    log_level: str = Field("INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$", description="DEBUG, INFO, WARNING or ERROR")
    retries: int = Field(3, ge=0, description="retries of a failing component (generation, evaluation, the p2p layer) "
                         "before the node checkpoints and stops")
    stop_timeout_s: float = Field(90.0, gt=0, description="after SIGTERM/SIGINT, exit (without a new checkpoint) if the "
                                  "current step has not finished within this many seconds")
    retry_backoff_s: float = Field(2.0, ge=0, description="wait before the first retry; doubles with each retry (at most 60 s)")

    @field_validator("out_dir", "eval_cache_dir", mode="before")
    @classmethod
    def _named(cls, value):
        """An empty value (an unset variable in `SAPO_RUN__OUT_DIR=$DIR`) would be the current folder."""
        if isinstance(value, str) and not value.strip():
            raise ValueError("empty: name the folder ('.' for the current one)")
        return value


_config_file: ContextVar[Path | None] = ContextVar("sapo_config_file", default=None)


class _FileSource(PydanticBaseSettingsSource):
    """Values from the TOML or YAML file named by `load_config` (lowest precedence after defaults)."""

    def get_field_value(self, field, field_name):  # pragma: no cover - whole-file source, see __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = _config_file.get()
        return read_config_file(path) if path else {}


class NodeConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SAPO_", env_nested_delimiter="__", extra="forbid", validate_assignment=True,
                                      allow_inf_nan=False)

    model: ModelConfig = Field(default_factory=ModelConfig)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    selection: SelectionConfig = Field(default_factory=SelectionConfig)
    p2p: P2PConfig = Field(default_factory=P2PConfig)
    status: StatusConfig = Field(default_factory=StatusConfig)

    @model_validator(mode="after")
    def _quantized_base_on_transformers(self) -> "NodeConfig":
        if self.model.quantize == "nf4" and self.generation.backend == "vllm":
            raise ValueError("model.quantize nf4 runs on the transformers backend: vLLM would load its own 16-bit copy "
                             "of the base (set generation.backend to transformers or auto)")
        return self

    @model_validator(mode="after")
    def _held_out_stream_apart(self) -> "NodeConfig":
        """The same seed draws the held-out tasks as training tasks: the node would train on what measures it."""
        if self.run.seed is not None and self.run.seed == self.tasks.eval_seed:
            raise ValueError(f"run.seed {self.run.seed} equals tasks.eval_seed: the node would train on its own held-out "
                             "tasks; choose another run.seed")
        return self

    @model_validator(mode="after")
    def _adapters_vllm_serves(self) -> "NodeConfig":
        rank, largest = self.model.lora.r, VLLM_LORA_RANKS[-1]
        if self.generation.vllm.lora_adapters and self.generation.backend != "transformers" and rank > largest:
            raise ValueError(f"generation.vllm.lora_adapters: vLLM serves LoRA ranks up to {largest}, not "
                             f"model.lora.r {rank}; lower the rank or turn lora_adapters off")
        return self

    def key_file(self) -> Path:
        return self.p2p.key_file or self.run.out_dir / "node.key"

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        return init_settings, env_settings, _FileSource(settings_cls)


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    try:
        data = tomllib.loads(text) if Path(path).suffix == ".toml" else yaml.safe_load(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, not {type(data).__name__}")
    return data


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> NodeConfig:
    """Build the node config; `overrides` are nested CLI values. Raises `ConfigError`."""
    token = _config_file.set(path)
    try:
        _check_env_sections()
        return NodeConfig(**(overrides or {}))
    except ValidationError as e:
        raise ConfigError(describe(e, NodeConfig)) from None
    except ValueError as e:  # pydantic-settings reports undecodable env values as SettingsError
        raise ConfigError(str(e)) from None
    finally:
        _config_file.reset(token)


def _check_env_sections() -> None:
    """pydantic-settings reads `SAPO_<SECTION>__<KEY>` only for the sections it knows, so a misspelt section
    (`SAPO_GRPOO__LR`) or a single underscore (`SAPO_RUN_ROUNDS`) would be dropped without a word. Other names
    with no `__` are the docker entrypoint's own (`SAPO_SLOT_DIR`)."""
    sections = list(NodeConfig.model_fields)
    for name in sorted(os.environ):
        head, nested, key = name.partition("__")
        section = head[len("SAPO_"):].lower() if head.upper().startswith("SAPO_") else None
        if section is None:
            continue
        if nested and section not in sections:
            close = difflib.get_close_matches(section, sections, n=1)
            hint = f" (did you mean SAPO_{close[0].upper()}__{key}?)" if close else ""
            raise ConfigError(f"{name}: unknown section {section!r}{hint}; sections: {', '.join(sections)}")
        first, _, rest = section.partition("_")
        if not nested and first in sections and rest in _section_model(first).model_fields:
            raise ConfigError(f"{name} is not read: a setting takes two underscores after its section, "
                              f"SAPO_{first.upper()}__{rest.upper()}")


def _section_model(section: str) -> type[BaseModel]:
    return NodeConfig.model_fields[section].annotation


def shown_default(dotted: str, info: Any) -> str:
    """A knob's default as JSON, for --help and docs (machine-specific paths shown generically)."""
    if dotted == "model.cache_dir":
        return "~/.cache/sapo-node"
    return json.dumps(to_jsonable_python(info.get_default(call_default_factory=True)))


def leaf_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    """Dotted names and FieldInfo of every knob, for CLI flags and docs."""
    out = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += leaf_fields(ann, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", info))
    return out
