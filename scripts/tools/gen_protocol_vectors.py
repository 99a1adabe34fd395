"""Write docs/protocol-vectors.json: conformance vectors for docs/PROTOCOL.md, computed by this code.

Encoded messages with the topic ids they were published under and the receiver's verdict, signed
GossipSub envelopes (the bytes signed, the signature and the whole pubsub message, as any libp2p
implementation builds them), built-in task references with their question and answer, and
completions with their reward. tests/test_protocol_vectors.py checks the code against the file (and
an implementation of section 5 written from the text alone against its tasks), so a change to either
shows up as a failing test; rerun this script only for a deliberate change of the protocol.

    .venv/bin/python scripts/tools/gen_protocol_vectors.py
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

import msgpack

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.validators import PUBSUB_SIGNING_PREFIX

from node.argtypes import script_parser
from p2p.config import Limits, P2PConfig
from p2p.policy import MessagePolicy
from p2p.shards import EPOCH_S, epoch_of, prefix, shard_key, shard_topic, shared_bits, topic_level
from p2p.wire import VERSION, Rejected
from rewards import TaskRef, regenerate, score_completion
from rewards.scoring import group_carries_signal

ROOT = Path(__file__).resolve().parents[2]

OUT = ROOT / "docs" / "protocol-vectors.json"
SEED = hashlib.sha256(b"sapo protocol vectors").digest()  # the signer's Ed25519 private key seed
KEYS = create_new_key_pair(SEED)
SIGNER = ID.from_pubkey(KEYS.public_key).to_base58()
NOW = 1_800_000_000.0
BASE = P2PConfig().rollout_topic_base()
EPOCH = epoch_of(NOW, EPOCH_S)  # NOW is the first second of this epoch: the previous one is still accepted
KEY, PREVIOUS = (shard_key(ID.from_base58(SIGNER).to_bytes(), e) for e in (EPOCH, EPOCH - 1))
PAST = next(k for k in (shard_key(ID.from_base58(SIGNER).to_bytes(), EPOCH - d) for d in range(2, 99))
            if prefix(k, 2) not in (prefix(KEY, 2), prefix(PREVIOUS, 2)))
TOPICS = [shard_topic(BASE, KEY, 1)]  # one of the three messages a signer at level 1 publishes (levels 0, 1, 2)
PREVIOUS_ONLY = shared_bits(KEY, PREVIOUS) + 1  # the first level where last epoch's shard is not this one's
NOT_ITS_SHARD = f"{BASE}/s" + next(b for b in ("00", "01", "10", "11") if b not in (prefix(KEY, 2), prefix(PREVIOUS, 2)))
RIGHT = regenerate(TaskRef("arith", {}, 0, 1353)).answer  # "8": the question is 4+4=?
GROUP = {"dataset": "arith", "config": {}, "seed": 0, "index": 1353,
         "completions": [f"<answer>{RIGHT}</answer>", "<answer>14</answer>"]}


def message(**changes) -> dict:
    return {"v": VERSION, "peer": SIGNER, "model": "tiny-a", "round": 17, "created": NOW - 1, "groups": [GROUP], **changes}


def packed(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


MESSAGES: dict[str, bytes] = {
    "valid": packed(message()),
    "valid, int created, unknown keys ignored": packed(message(created=int(NOW), extra="x",
                                                                 groups=[{**GROUP, "note": 1}])),
    "float32 created": b"\x86" + b"".join(packed(k) + (b"\xca" + struct.pack(">f", NOW) if k == "created"
                                                      else packed(v)) for k, v in message().items()),
    "version 1": packed(message(v=1)),
    "version is a bool (true)": packed(message(v=True)),
    "version 3.0 (a float)": packed(message(v=3.0)),
    "empty payload": b"",
    "round is a bool": packed(message(round=True)),
    "NaN created": packed(message(created=float("nan"))),
    "infinite config value": packed(message(groups=[{**GROUP, "config": {"max_operand": float("inf")}}])),
    "binary completion": packed(message(groups=[{**GROUP, "completions": [b"<answer>1</answer>"]}])),
    "ext value": packed(message(groups=[{**GROUP, "config": {"k": msgpack.ExtType(1, b"x")}}])),
    "repeated key": b"\x87" + packed("v") + packed(1) + packed(message())[1:],
    "integer map key": packed({1: 1, **message()}),
    "not msgpack": b"\xc1",
    "top level array": packed([message()]),
    "no groups": packed(message(groups=[])),
    "65 groups": packed(message(groups=[{**GROUP, "index": i} for i in range(65)])),
    "65 completions": packed(message(groups=[{**GROUP, "completions": ["x"] * 65}])),
    "8193 code points": packed(message(groups=[{**GROUP, "completions": ["é" * 8175 + "<answer>1</answer>", "x"]}])),
    "8192 code points (16366 bytes)": packed(message(groups=[{**GROUP, "completions": [
        "é" * 8174 + f"<answer>{RIGHT}</answer>", "<answer>2</answer>"]}])),
    "every group one answer": packed(message(groups=[{**GROUP, "completions": ["<answer>7</answer>", "<answer>7</answer>\n"]},
                                                     {**GROUP, "index": 1, "completions": ["no answer", "none"]}])),
    "two different wrong answers (the built-in task scores both 0)": packed(message(groups=[
        {**GROUP, "completions": ["<answer>12</answer>", "<answer>14</answer>"]}])),
    "a built-in task's config no one can rebuild": packed(message(groups=[{**GROUP, "config": {"max_operand": 0}}])),
    "another author": packed(message(peer="12D3KooWSomebodyElseSomebodyElseSomebodyElseSomebod")),
    "31 s in the future": packed(message(created=NOW + 31)),
    "301 s old": packed(message(created=NOW - 301)),
    "too large": packed(message(groups=[{**GROUP, "index": i, "completions": ["x" * 8000] * 8} for i in range(5)])),
}

TASKS = [("arith", {}, 0, 1353), ("arith", {"max_operand": 9, "ops": "+-"}, 0, 1353), ("arith", {}, -3, 0),
         ("arith", {"max_operand": 1000000, "ops": "*"}, 2**62, 7), ("reverse", {}, 5, 11),
         ("reverse", {"min_len": 1, "max_len": 64, "alphabet": "ab"}, 1, 2), ("count", {}, 7, 99),
         ("count", {"alphabet": "héllo"}, 0, 3)]

SCORES = [("arith", {}, 0, 1353, c) for c in (
    "<answer>{a}</answer>", "reasoning first <answer>{a}</answer>\n", "<answer> {a} </answer>",
    "<answer>{a}</answer> trailing text", "<answer>{a}</answer><answer>{a}</answer>", "{a}", "<answer></answer>",
    "</answer><answer>{a}</answer>", "<answer>0{a}</answer>")]


TOPIC_CASES: dict[str, list[str]] = {  # the valid message under other topic ids
    "level 0 (every signer's level-0 shard)": [f"{BASE}/s"],
    "the signer's level-24 shard": [shard_topic(BASE, KEY, 24)],
    "a shard that is not the signer's": [NOT_ITS_SHARD],
    "the signer's shard of the previous epoch (its clock a little behind)": [shard_topic(BASE, PREVIOUS, PREVIOUS_ONLY)],
    "the signer's shard of an epoch long past": [shard_topic(BASE, PAST, 2)],
    "no topic": [],
    "level 0 twice": [f"{BASE}/s", f"{BASE}/s"],
    "levels 0 and 1 of the signer's shard in one message": [shard_topic(BASE, KEY, lv) for lv in (0, 1)],
    "levels 0, 1 and 2 in one message (protocol 2)": [shard_topic(BASE, KEY, lv) for lv in (0, 1, 2)],
    "a level-25 topic": [shard_topic(BASE, KEY, 24) + "0"],
    "another network's topic": [f"{BASE}/s".replace("/local/", "/testnet/")],
    "protocol 2 topic": [BASE.rsplit("/", 1)[0] + "/2/s"],
    "protocol 1 topic": [BASE.rsplit("/", 1)[0] + "/1"],
}


def envelope(name: str, topic: str, seqno: int, tamper: bool = False) -> dict:
    """The valid payload as one signed GossipSub message: `signed` is what the signature covers (the
    prefix and the message's fields 1-4: from, data, seqno, topic), `message` the whole protobuf (fields
    5 and 6: signature and the signer's public key). `tamper` flips a bit of the signature."""
    msg = rpc_pb2.Message(from_id=ID.from_base58(SIGNER).to_bytes(), data=MESSAGES["valid"],
                          seqno=seqno.to_bytes(8, "big"), topicIDs=[topic])
    signed = PUBSUB_SIGNING_PREFIX.encode() + msg.SerializeToString()
    signature = KEYS.private_key.sign(signed)
    msg.signature = bytes([signature[0] ^ 1]) + signature[1:] if tamper else signature
    msg.key = KEYS.public_key.serialize()
    return {"name": name, "topic": topic, "seqno": msg.seqno.hex(), "signed": signed.hex(), "signature": msg.signature.hex(),
            "message": msg.SerializeToString().hex(), "signature_valid": not tamper}


ENVELOPES = [envelope("level 1 (the signer's own level)", TOPICS[0], 1), envelope("level 0", f"{BASE}/s", 2),
             envelope("level 2", shard_topic(BASE, KEY, 2), 3), envelope("a bit of the signature flipped", TOPICS[0], 4, True)]


def verdict(data: bytes, topics: list[str]) -> str:
    try:
        MessagePolicy(Limits(), BASE, EPOCH_S, signal=group_carries_signal).check(data, SIGNER, topics, now=NOW)
    except Rejected as r:
        return r.reason
    return "accepted"


def at_a_node(data: bytes, topics: list[str]) -> str:
    """What a running node does: a message on no topic a node of this network can read is dropped before any
    validator sees it (PROTOCOL.md section 4, `dropped_unsubscribed`); any other gets the verdict."""
    if not any(topic_level(BASE, t) is not None for t in topics):
        return "dropped_unsubscribed"
    return verdict(data, topics)


def main() -> int:
    tasks = []
    for dataset, config, seed, index in TASKS:
        task = regenerate(TaskRef(dataset, config, seed, index))
        tasks.append({"dataset": dataset, "config": config, "seed": seed, "index": index,
                      "question": task.question, "answer": task.answer})
    scores = []
    for dataset, config, seed, index, template in SCORES:
        task = regenerate(TaskRef(dataset, config, seed, index))
        completion = template.format(a=task.answer)
        scores.append({"dataset": dataset, "config": config, "seed": seed, "index": index, "completion": completion,
                       "reward": score_completion(task, completion).reward})
    vectors = {
        "about": f"Conformance vectors for docs/PROTOCOL.md (wire protocol {VERSION}), written by "
                 "scripts/tools/gen_protocol_vectors.py. messages: hex msgpack bytes, signed by `signer`, published under "
                 "`topics` and received at unix time `now` on the network whose rollout topics start with "
                 "`topic_base` (shard epoch `shard_epoch_s`), with the default limits, and the verdict (accepted, or the rejection reason); "
                 "`node`: what a running node does with it, the verdict, or `dropped_unsubscribed` for a message on no "
                 "topic a node of this network reads (GossipSub drops it before validation, and does not forward it). "
                 "envelopes: the valid message as GossipSub messages (StrictSign) by the signer whose Ed25519 "
                 "private key seed is `signer_seed`: the bytes signed, the signature and the protobuf. "
                 "tasks: built-in task references and the question and answer they generate. scores: completions "
                 "and their reward (format weight 0).",
        "signer": SIGNER, "signer_seed": SEED.hex(), "signer_public_key": KEYS.public_key.serialize().hex(),
        "now": NOW, "topic_base": BASE, "shard_epoch_s": EPOCH_S,
        "messages": [{"name": name, "hex": data.hex(), "topics": TOPICS, "verdict": verdict(data, TOPICS),
                      "node": at_a_node(data, TOPICS)} for name, data in MESSAGES.items()]
        + [{"name": name, "hex": MESSAGES["valid"].hex(), "topics": topics, "verdict": verdict(MESSAGES["valid"], topics),
            "node": at_a_node(MESSAGES["valid"], topics)} for name, topics in TOPIC_CASES.items()],
        "envelopes": ENVELOPES, "tasks": tasks, "scores": scores,
    }
    OUT.write_text(json.dumps(vectors, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}: {len(MESSAGES) + len(TOPIC_CASES)} messages, {len(ENVELOPES)} envelopes, {len(tasks)} tasks, "
          f"{len(scores)} scores")
    return 0


if __name__ == "__main__":
    script_parser(__doc__).parse_args()  # no flags: --help prints this, and nothing is written
    sys.exit(main())
