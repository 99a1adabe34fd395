"""The starting model's evaluation, kept on disk and reused by runs that start from the same model.

An experiment's arms (alone, in a swarm, each seed) share a base model and an evaluation set, so they would each
spend minutes measuring the same numbers at round 0. The key is a digest of what decides those numbers: the weights,
the encoded evaluation prompts and their answers, the sampling and the backend. It does not cover the code, so a
cache belongs to one version of the project (the experiment driver keeps it inside its output folder).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Sequence

import torch

from node.metrics import Evaluation
from rewards.tasks import Task
from trainer.generation.base import Generator
from trainer.policy import Policy, encode_prompts

log = logging.getLogger(__name__)


def weights_digest(model: torch.nn.Module) -> str:
    """A digest of every tensor's name, dtype, shape and bytes (about a second per 500 MB)."""
    h = hashlib.blake2b(digest_size=20)
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def evaluation_key(policy: Policy, generator: Generator, tasks: Sequence[Task], sampling: dict) -> str:
    """What decides an evaluation's numbers, as one digest (`sampling`: the generation settings and k)."""
    h = hashlib.blake2b(digest_size=20)
    h.update(weights_digest(policy.model).encode())
    h.update(json.dumps({
        "prompts": encode_prompts(policy, [t.prompt for t in tasks]),
        "tasks": [[t.ref.dataset, t.question, t.answer] for t in tasks],
        "sampling": sampling,
        "backend": type(generator).__name__, "device": str(next(policy.model.parameters()).device),
        "torch": torch.__version__,
    }, sort_keys=True, default=str).encode())
    return h.hexdigest()


class EvalCache:
    """Evaluations by key, one JSON file each, written whole (nodes of one swarm may write the same key at once)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def get(self, key: str) -> Evaluation | None:
        path = self.folder / f"{key}.json"
        try:
            found = Evaluation(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as e:  # a damaged entry is measured again, and then rewritten
            log.warning("evaluation cache: %s is unreadable (%s); evaluating", path, e)
            return None
        log.info("evaluation of the starting model reused from %s", path)
        return found

    def put(self, key: str, evaluation: Evaluation) -> None:
        """Keep `evaluation`; a cache that cannot be written costs later runs time, not this run its rounds."""
        tmp = self.folder / f".{key}.{os.getpid()}.tmp"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(dataclasses.asdict(evaluation)))
            tmp.replace(self.folder / f"{key}.json")
        except OSError as e:
            log.warning("evaluation cache: cannot write into %s (%s); this evaluation is not kept", self.folder, e)
