"""Per-round metrics, one JSON object per line in `metrics.jsonl`."""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from itertools import chain
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Evaluation:
    """The held-out measurement: greedy accuracy and, with `tasks.eval_samples` k, the expected accuracy (the mean
    over k completions per task at the sampling temperature), each overall and per dataset. All None: not evaluated."""
    accuracy: float | None = None
    by_dataset: dict[str, float] | None = None
    expected: float | None = None
    expected_by_dataset: dict[str, float] | None = None

    def row_fields(self) -> dict:
        """Its fields as a round's metrics line names them."""
        return {"eval_accuracy": self.accuracy, "eval_by_dataset": self.by_dataset, "eval_expected": self.expected,
                "eval_expected_by_dataset": self.expected_by_dataset}


@dataclass
class RoundMetrics:
    round: int
    time: float
    reward_mean: float | None
    accuracy_train: float | None
    eval_accuracy: float | None
    n_local: int
    n_external: int
    tokens_generated: int
    seconds_generate: float
    seconds_train: float
    seconds_other: float
    seconds_push: float = 0.0  # of seconds_train, pushing the new weights into the generator
    eval_by_dataset: dict[str, float] | None = None
    eval_expected: float | None = None  # expected held-out accuracy: the mean over tasks.eval_samples completions a task
    eval_expected_by_dataset: dict[str, float] | None = None
    probe_accuracy: float | None = None  # the early probe (run.probe_tasks of the held-out tasks): round 0 and its rounds
    probe_by_dataset: dict[str, float] | None = None
    batch_reward_mean: float | None = None  # the paper's metric: mean reward of the round's training batch, local + external groups
    groups_trained: int = 0
    groups_dropped_uniform: int = 0
    local_informative: int = 0  # local groups whose rewards differ (the others carry no gradient)
    external_inspected: int = 0  # pool groups re-scored this round
    external_informative: int = 0  # of those, groups whose rewards differ
    loss: float | None = None
    kl: float | None = None
    clip_frac: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    step_kl: float | None = None  # the policy's per-token KL across the step, measured when grpo.target_kl is set
    lr_next: float | None = None  # the rate the next step takes (the step-size controller's, when on)
    weight_version: int = 0
    n_external_used: int = 0  # external groups that carried signal into the loss
    external_masked: int = 0  # external completions masked as off this policy's support
    external_gated: int = 0  # external completions to push up that the support gate left out (rule `guarded`)
    external_shaped: int = 0  # external completions trained with the policy-shaped weight (rule `scoped`)
    n_peer_tasks: int = 0  # of n_local, tasks of peers' groups sampled here (selection.when_short = peer_tasks)
    torch_threads: int | None = None  # CPU threads torch used this round (node/threads.py)
    seconds_gc: float = 0.0  # of the round, seconds Python's cyclic collector ran, in any thread (node/collector.py)
    n_held_out_skipped: int = 0  # local draws passed over as evaluation questions (rewards/held_out.py)
    external_held_back: int = 0  # pool groups of peers tried without use left out of the round's order (kept pooled)
    seconds_gate: float = 0.0  # of the round, seconds computing this node's log-probs of external completions
    support_cutoff: float | None = None  # the support gate's cut-off after the round (mean token log-prob)
    external_reward_mean: float | None = None  # this node's scores of the external completions
    external_peers: int = 0  # distinct peers the round's external groups came from
    external_sources: dict[str, int] | None = None  # groups taken this round, by the peer that shared them
    external_families: dict[str, int] | None = None  # the external groups taken, by dataset (the dose per family)
    external_dropped: dict[str, int] | None = None  # pool groups this node could not use, by reason
    peers: int = 0
    groups_published: int = 0  # local groups shared with the swarm this round
    n_external_received: int = 0  # groups other peers shared that entered the pool this round
    p2p: dict | None = None  # cumulative gossip and pool counters, drops by reason included
    micro_batch: int = 0  # sequences per forward and backward pass this round
    memory_peak_gb: float | None = None  # this round's peak: resident size on a host, reserved on a CUDA card


class MetricsLog:
    """Appends a line a round. A node that runs for days rotates the file: past `rotate_bytes` its lines move, byte for
    byte and gzip-compressed (about a tenth of the size), to `metrics.<first>-<last>.jsonl.gz` (the rounds they hold)
    and the file starts again. Nothing is deleted; `rows()` reads the archives and the file as one history."""

    def __init__(self, path: Path, rotate_bytes: int | None = None):
        self.path = path
        self.rotate_bytes = rotate_bytes
        path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, m: RoundMetrics) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(m)) + "\n")
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        if self.rotate_bytes and size >= self.rotate_bytes:
            self._rotate()

    def _rotate(self) -> None:
        """Archive first, then empty the file: a crash between the two leaves lines in both, which `rewind` (run at
        every start) recognises as the archive's own and drops from the file."""
        data = self.path.read_bytes()
        rounds = [r for r in map(_round_of, data.splitlines()) if r is not None]
        if not rounds:
            return
        name = ARCHIVE.format(rounds[0], rounds[-1])
        _write_archive(self.path.with_name(name), data)
        _replace(self.path, b"")
        log.info("metrics rounds %d-%d moved to %s", rounds[0], rounds[-1], name)

    def archives(self) -> list[tuple[int, int, Path]]:
        """(first round, last round, path) of each archive, oldest first."""
        found = []
        for p in self.path.parent.glob("metrics.*-*.jsonl.gz"):
            m = ARCHIVE_NAME.fullmatch(p.name)
            if m:
                found.append((int(m[1]), int(m[2]), p))
        return sorted(found)

    def archived_rows(self) -> Iterator[dict]:
        """The archives' round lines, oldest first, read one archive at a time."""
        for *_, path in self.archives():
            yield from _rows(_read_archive(path))

    def rows(self) -> list[dict]:
        """Every round's line, from the archives and then the file (lines that are not a round's are skipped)."""
        return [*self.archived_rows(), *_rows(self.path.read_bytes() if self.path.exists() else b"")]

    def rewind(self, to_round: int) -> int:
        """On resume, set aside lines of rounds after the checkpoint (they will be run again), and lines that
        are not a round's (torn by a crash mid-write, or edited by hand).

        Nothing is deleted: those lines move, byte for byte, to `metrics.rolled-back.jsonl`. Returns how many moved.
        """
        from_archives, unreadable = self._rewind_archives(to_round), 0
        lines = self.path.read_bytes().splitlines() if self.path.exists() else []
        archived = self._archived_copies(lines)
        keep, moved, duplicate = [], [], 0
        for line in lines:
            if line in archived:  # a crash between archiving and emptying the file
                duplicate += 1
            elif line.strip():
                round_ = _round_of(line)
                unreadable += round_ is None
                (moved if round_ is None or round_ > to_round else keep).append(line)
        self._set_aside(moved)
        if moved or duplicate:
            _replace(self.path, b"".join(line + b"\n" for line in keep))
        moved += from_archives
        if moved:
            log.warning("moved %d metrics lines %s to metrics.rolled-back.jsonl%s", len(moved),
                        f"after round {to_round}" if to_round >= 0 else "of an earlier start that left no checkpoint",
                        f" ({unreadable} of them not a round's line)" if unreadable else "")
        return len(moved)

    def _rewind_archives(self, to_round: int) -> list[bytes]:
        """An archive with rounds after `to_round` (a resume from an older checkpoint) gives them up: set aside first,
        then the archive rewritten under its new last round; a crash before the old one is removed leaves two with
        one first round, and the longer (the old) goes."""
        moved: list[bytes] = []
        by_first: dict[int, list[tuple[int, Path]]] = {}
        for first, last, path in self.archives():
            by_first.setdefault(first, []).append((last, path))
        for first, found in by_first.items():
            (last, path), *stale = sorted(found)
            for _, old in stale:
                old.unlink()
            if last <= to_round:
                continue
            lines = _read_archive(path).splitlines()
            kept = [line for line in lines if (_round_of(line) or 0) <= to_round]
            later = [line for line in lines if (_round_of(line) or 0) > to_round]
            self._set_aside(later)
            moved += later
            if kept:
                new_last = max((_round_of(line) or 0) for line in kept)
                _write_archive(path.with_name(ARCHIVE.format(first, new_last)), b"".join(line + b"\n" for line in kept))
            if not kept or new_last != last:
                path.unlink()
        return moved

    def _archived_copies(self, lines: list[bytes]) -> set[bytes]:
        """The newest archive's lines, where the file starts at a round that archive already holds."""
        found = self.archives()
        first = next((r for r in map(_round_of, lines) if r is not None), None)
        if not found or first is None or first > found[-1][1]:
            return set()
        return set(_read_archive(found[-1][2]).splitlines())

    def _set_aside(self, lines: list[bytes]) -> None:
        if lines:
            with open(self.path.with_name("metrics.rolled-back.jsonl"), "ab") as f:
                f.write(b"".join(line + b"\n" for line in lines))

    def start_row(self) -> dict | None:
        """Round 0's line: the starts a resumed node's learning watch measures against."""
        live = _rows(self.path.read_bytes() if self.path.exists() else b"")
        return next((r for r in chain(self.archived_rows(), live) if r["round"] == 0), None)


class MetricsError(RuntimeError):
    """A metrics archive that cannot be read: named, and left as it is."""


ARCHIVE = "metrics.{}-{}.jsonl.gz"
ARCHIVE_NAME = re.compile(r"metrics\.(\d+)-(\d+)\.jsonl\.gz")


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_archive(path: Path) -> bytes:
    try:
        return gzip.decompress(path.read_bytes())
    except (OSError, EOFError, zlib.error) as e:
        raise MetricsError(f"metrics archive {path} cannot be read ({e}): move it aside to resume; nothing was "
                           "changed") from None


def _write_archive(path: Path, data: bytes) -> None:
    _replace(path, gzip.compress(data, mtime=0))


def _rows(data: bytes) -> Iterator[dict]:
    return (json.loads(line) for line in data.splitlines() if _round_of(line) is not None)


def _round_of(line: bytes) -> int | None:
    """The round a metrics line records, or None where it is not a round's line."""
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return None
    round_ = record.get("round") if isinstance(record, dict) else None
    return round_ if type(round_) is int else None
