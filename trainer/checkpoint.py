"""Atomic checkpoints: written to a temporary folder, fsynced, then renamed into place.

A folder named `round-NNNNNN` is always complete; a crash mid-write leaves only a `.tmp` folder,
which the next save clears. The newest K complete checkpoints are kept.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
NAME = re.compile(r"^round-(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used; the message names it."""


@dataclass
class Checkpoint:
    path: Path
    round: int
    state: dict[str, Any]  # node state: JSON-serialisable
    trainer_state: dict[str, Any]  # optimizer, scheduler, RNG

    @property
    def model_dir(self) -> Path:
        return self.path / "model"


def _fsync_tree(root: Path) -> None:
    for path in [*root.rglob("*"), root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save(directory: Path, round_: int, model, tokenizer, trainer_state: dict[str, Any], state: dict[str, Any], keep: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"round-{round_:06d}"
    tmp = directory / f".round-{round_:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp / "model")
        tokenizer.save_pretrained(tmp / "model")
        torch.save(trainer_state, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps({"round": round_, **state}, indent=2))
        _fsync_tree(tmp)
    except Exception as e:  # a full disk reads as OSError from one writer, RuntimeError ("unexpected pos") from torch's
        shutil.rmtree(tmp, ignore_errors=True)
        free_gb = shutil.disk_usage(directory).free / 1e9
        raise CheckpointError(f"cannot write checkpoint {final} ({type(e).__name__}: {e}; {free_gb:.1f} GB free on its "
                              "disk); the last complete checkpoint is kept") from None
    if final.exists():  # a round already on disk is replaced, so saving is idempotent
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_tree(directory)
    for old in complete(directory)[:-keep]:
        shutil.rmtree(old)
    log.info("checkpoint %s written", final)
    return final


def round_of(path: Path) -> int:
    """The round a complete checkpoint's folder is named for."""
    return int(NAME.match(path.name)[1])


def complete(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and NAME.match(p.name)]
    return sorted(found, key=round_of)


def load_latest(directory: Path, state_keys: tuple[str, ...] = (), trainer_keys: tuple[str, ...] = ()) -> Checkpoint | None:
    """The newest complete checkpoint, or None. `state_keys` and `trainer_keys`: what the caller's resume reads
    from state.json and trainer.pt, so that a file edited or cut short reads as unusable here, not as a
    KeyError later."""
    found = complete(directory)
    if not found:
        return None
    path = found[-1]
    try:
        state = json.loads((path / "state.json").read_text())
        trainer_state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
        if not (path / "model" / "config.json").exists() and not (path / "model" / "adapter_config.json").exists():
            raise FileNotFoundError("model/ holds no config")
        if not isinstance(state, dict) or not isinstance(trainer_state, dict):
            raise ValueError("state.json and trainer.pt each hold a map")
        missing = [f"state.json {k}" for k in ("round", *state_keys) if k not in state]
        missing += [f"trainer.pt {k}" for k in trainer_keys if k not in trainer_state]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        if state["round"] != round_of(path):
            raise ValueError(f"state.json says round {state['round']!r}")
        return Checkpoint(path=path, round=state["round"], state=state, trainer_state=trainer_state)
    except Exception as e:  # noqa: BLE001 - any failure to read these files means the checkpoint is unusable
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({e}); move it aside to resume from an older one"
        ) from None
