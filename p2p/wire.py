"""Wire protocol v3 (docs/PROTOCOL.md): the rollout message, its msgpack codec and its limits.

Nothing here is trusted by the receiver beyond its shape: there is no answer or reward field to
trust. Every rejection carries one of `REASONS`, so the caller can count it.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import msgpack
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, ValidationError

from p2p.config import Limits
from p2p.network import VERSION
INT64 = 2**63 - 1

REASONS = ("too_large", "undecodable", "version", "schema", "too_many_groups", "too_many_completions",
           "completion_too_long", "wrong_shard", "sender_mismatch", "from_future", "too_old", "duplicate", "over_budget",
           "no_signal")


class Rejected(ValueError):
    def __init__(self, reason: str, detail: str):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)  # unknown fields: forward compatibility


class WireGroup(_Wire):
    """A task reference (the receiver regenerates question and answer from it) and completion texts."""

    dataset: StrictStr = Field(min_length=1, max_length=128)
    config: dict[StrictStr, Any] = Field(default_factory=dict)
    seed: StrictInt = Field(ge=-INT64, le=INT64)
    index: StrictInt = Field(ge=0, le=INT64)
    completions: list[StrictStr] = Field(min_length=1)

    def key(self) -> str:
        """Content hash of the group: the same task and completions from anyone is one group."""
        body = msgpack.packb([self.dataset, self.config, self.seed, self.index, sorted(self.completions)])
        return hashlib.sha256(body).hexdigest()


class WireMessage(_Wire):
    v: StrictInt
    peer: StrictStr = Field(min_length=1, max_length=128, description="base58 peer id of the author")
    model: StrictStr = Field(max_length=256, description="the author's model id, informational")
    round: StrictInt = Field(ge=0, le=INT64)
    created: StrictFloat | StrictInt = Field(description="unix seconds when the author built the message")
    groups: list[WireGroup] = Field(min_length=1)


def encode(msg: WireMessage) -> bytes:
    return msgpack.packb(msg.model_dump(), use_bin_type=True)


MAX_DEPTH = 16  # maps and arrays nested in a message, its envelope included


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _DuplicateKey(f"a map repeats a key ({len(pairs) - len(out)} repeated)")
    return out


def check_values(value: Any, where: str = "message", depth: int = 0) -> None:
    """The wire's value domain (PROTOCOL.md section 3): nil, bool, int, finite float, str, and arrays
    and maps of them; no binary, no extension types (timestamps included), no NaN or infinity."""
    if depth > MAX_DEPTH:
        raise Rejected("schema", f"{where}: nested deeper than {MAX_DEPTH}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Rejected("schema", f"{where}: {value} is not a finite number")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_values(item, f"{where}[{i}]", depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_values(item, f"{where}.{key}", depth + 1)
    elif value is not None and not isinstance(value, (bool, int, str)):
        raise Rejected("schema", f"{where}: {type(value).__name__} values are not part of the protocol")


def decode(data: bytes, limits: Limits) -> WireMessage:
    """Parse and check shape and limits. Raises `Rejected`."""
    if len(data) > limits.max_message_bytes:
        raise Rejected("too_large", f"{len(data)} bytes > {limits.max_message_bytes}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise Rejected("schema", str(e)) from None
    except Exception as e:  # msgpack raises ExtraData, ValueError, UnicodeDecodeError, ...
        raise Rejected("undecodable", f"not msgpack ({type(e).__name__})") from None
    if not isinstance(raw, dict):
        raise Rejected("schema", f"top level is {type(raw).__name__}, not a map")
    check_values(raw)
    if type(raw.get("v")) is int and raw["v"] != VERSION:  # a bool is not an int here: `schema`
        raise Rejected("version", f"major version {raw['v']} (this node speaks {VERSION})")
    try:
        msg = WireMessage.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        raise Rejected("schema", f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    if len(msg.groups) > limits.max_groups:
        raise Rejected("too_many_groups", f"{len(msg.groups)} > {limits.max_groups}")
    for g in msg.groups:
        if len(g.completions) > limits.max_completions:
            raise Rejected("too_many_completions", f"{len(g.completions)} > {limits.max_completions}")
        longest = max(len(c) for c in g.completions)
        if longest > limits.max_completion_chars:
            raise Rejected("completion_too_long", f"{longest} chars > {limits.max_completion_chars}")
    return msg


def pack_groups(peer: str, model: str, round_: int, created: float, groups: list[WireGroup],
                limits: Limits) -> tuple[list[bytes], int]:
    """Encode groups into as few messages as the limits allow. Returns (payloads, groups left out).

    A group is left out only when it alone breaks a limit (too many or too long completions, or
    too many bytes); the caller logs and counts it.
    """
    def envelope(gs: list[WireGroup]) -> WireMessage:
        return WireMessage(v=VERSION, peer=peer, model=model, round=round_, created=created, groups=gs)

    overhead = len(encode(envelope([groups[0]]))) - len(msgpack.packb(groups[0].model_dump())) + 8 if groups else 0
    payloads: list[bytes] = []
    batch: list[WireGroup] = []
    size, skipped = overhead, 0
    for g in groups:
        n = len(msgpack.packb(g.model_dump(), use_bin_type=True))
        too_long = any(len(c) > limits.max_completion_chars for c in g.completions)
        if too_long or len(g.completions) > limits.max_completions or overhead + n > limits.max_message_bytes:
            skipped += 1
            continue
        if batch and (size + n > limits.max_message_bytes or len(batch) == limits.max_groups):
            payloads.append(encode(envelope(batch)))
            batch, size = [], overhead
        batch.append(g)
        size += n
    if batch:
        payloads.append(encode(envelope(batch)))
    return payloads, skipped
