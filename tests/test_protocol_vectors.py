"""docs/protocol-vectors.json against the code, and PROTOCOL.md section 5 (built-in tasks) written out
from its text alone against the vectors: the spec, the vectors and the code cannot drift apart."""

from __future__ import annotations

import hashlib
import json

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.validators import PUBSUB_SIGNING_PREFIX, signature_validator

from p2p.config import Limits, P2PConfig
from p2p.host import GossipHost
from p2p.policy import MessagePolicy
from p2p.shards import topic_level
from p2p.wire import Rejected
from rewards import TaskRef, regenerate, score_completion
from rewards.scoring import group_carries_signal
from tests.conftest import ROOT

VECTORS = json.loads((ROOT / "docs" / "protocol-vectors.json").read_text())


@pytest.mark.parametrize("case", VECTORS["messages"], ids=lambda c: c["name"])
def test_each_message_vector_gets_its_verdict(case):
    policy = MessagePolicy(Limits(), VECTORS["topic_base"], VECTORS["shard_epoch_s"], signal=group_carries_signal)
    try:
        policy.check(bytes.fromhex(case["hex"]), VECTORS["signer"], case["topics"], now=VECTORS["now"])
        verdict = "accepted"
    except Rejected as r:
        verdict = r.reason
    assert verdict == case["verdict"]


def test_each_message_vector_says_what_a_node_does_with_it():
    """A node subscribed to every topic of this network that the vectors name still never validates a message
    that names none of them: py-libp2p drops it first (`dropped_unsubscribed`); every other gets its verdict."""
    cfg = P2PConfig(network="local")
    assert cfg.rollout_topic_base() == VECTORS["topic_base"]
    policy = MessagePolicy(cfg.limits, cfg.rollout_topic_base(), signal=group_carries_signal)
    host = GossipHost(cfg, create_new_key_pair(), policy, on_message=lambda m: None)
    for topic in {t for case in VECTORS["messages"] for t in case["topics"] if topic_level(VECTORS["topic_base"], t) is not None}:
        host.pubsub.subscribed_topics_receive[topic] = None
    dropped = []
    for case in VECTORS["messages"]:
        read = host.pubsub._is_subscribed_to_msg(rpc_pb2.Message(data=bytes.fromhex(case["hex"]), topicIDs=case["topics"]))
        assert case["node"] == (case["verdict"] if read else "dropped_unsubscribed"), case["name"]
        dropped += [] if read else [case["name"]]
    assert host.counts["dropped_unsubscribed"] == len(dropped) == 5  # no topic, level 25, another network, protocols 1, 2


@pytest.mark.parametrize("case", VECTORS["envelopes"], ids=lambda c: c["name"])
def test_each_envelope_vector_is_what_a_node_signs_and_verifies(case):
    # what another libp2p implementation must produce and accept: StrictSign over one topic
    keys = create_new_key_pair(bytes.fromhex(VECTORS["signer_seed"]))
    assert ID.from_pubkey(keys.public_key).to_base58() == VECTORS["signer"]
    assert keys.public_key.serialize().hex() == VECTORS["signer_public_key"]
    msg = rpc_pb2.Message.FromString(bytes.fromhex(case["message"]))
    assert list(msg.topicIDs) == [case["topic"]] and msg.seqno.hex() == case["seqno"]
    assert bytes.fromhex(case["signed"]) == PUBSUB_SIGNING_PREFIX.encode() + rpc_pb2.Message(
        from_id=msg.from_id, data=msg.data, seqno=msg.seqno, topicIDs=msg.topicIDs).SerializeToString()
    assert signature_validator(msg) is case["signature_valid"]
    if not case["signature_valid"]:
        return
    # the node's own publishing path (GossipHost's pubsub, StrictSign) builds these very bytes
    cfg = P2PConfig(network="local")
    host = GossipHost(cfg, keys, MessagePolicy(cfg.limits, cfg.rollout_topic_base(), signal=group_carries_signal), on_message=lambda m: None)
    sent: list[rpc_pb2.Message] = []

    async def capture(forwarder, message):
        sent.append(message)

    host.pubsub._next_seqno = lambda: bytes.fromhex(case["seqno"])
    host.pubsub.push_msg = capture
    trio.run(host.pubsub.publish, [case["topic"]], msg.data)
    assert sent[0].SerializeToString().hex() == case["message"]
    policy = MessagePolicy(Limits(), VECTORS["topic_base"], VECTORS["shard_epoch_s"], signal=group_carries_signal)
    policy.check(msg.data, ID(msg.from_id).to_base58(), list(msg.topicIDs), now=VECTORS["now"])  # accepted


@pytest.mark.parametrize("case", VECTORS["scores"], ids=lambda c: repr(c["completion"]))
def test_each_completion_vector_gets_its_reward(case):
    task = regenerate(TaskRef(case["dataset"], case["config"], case["seed"], case["index"]))
    assert score_completion(task, case["completion"]).reward == case["reward"]


class SpecRandom:
    """PROTOCOL.md section 5 as written: MT19937 seeded by init_by_array, draws by rejection sampling."""

    def __init__(self, dataset: str, config: dict, seed: int, index: int):
        key = json.dumps([dataset, config, seed, index], sort_keys=True, separators=(",", ":"))
        s = int.from_bytes(hashlib.sha256(key.encode("ascii")).digest()[:8], "big")
        words = [s & 0xFFFFFFFF, s >> 32] if s >> 32 else [s]
        mt = [19650218] + [0] * 623
        for i in range(1, 624):
            mt[i] = (1812433253 * (mt[i - 1] ^ (mt[i - 1] >> 30)) + i) & 0xFFFFFFFF
        i, j = 1, 0
        for _ in range(max(624, len(words))):
            mt[i] = ((mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1664525)) + words[j] + j) & 0xFFFFFFFF
            i, j = i + 1, (j + 1) % len(words)
            if i == 624:
                mt[0], i = mt[623], 1
        for _ in range(623):
            mt[i] = ((mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1566083941)) - i) & 0xFFFFFFFF
            i += 1
            if i == 624:
                mt[0], i = mt[623], 1
        mt[0] = 0x80000000
        self.mt, self.next = mt, 624

    def uint32(self) -> int:
        if self.next == 624:
            mt = self.mt
            for k in range(624):
                y = (mt[k] & 0x80000000) | (mt[(k + 1) % 624] & 0x7FFFFFFF)
                mt[k] = mt[(k + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            self.next = 0
        y = self.mt[self.next]
        self.next += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        return y ^ (y >> 18)

    def below(self, n: int) -> int:
        k = n.bit_length()
        while (r := self.uint32() >> (32 - k)) >= n:
            pass
        return r

    def pick(self, text: str) -> str:
        return text[self.below(len(text))]


def spec_task(dataset: str, config: dict, seed: int, index: int) -> tuple[str, str]:
    rng = SpecRandom(dataset, config, seed, index)
    if dataset == "arith":
        cfg = {"max_operand": 9, "ops": "+-", "max_second": None, **config}
        op = rng.pick(cfg["ops"])
        a = rng.below(cfg["max_operand"] + 1)
        b = rng.below((cfg["max_second"] if cfg["max_second"] is not None else cfg["max_operand"]) + 1)
        if op == "-" and b > a:
            a, b = b, a
        return f"{a}{op}{b}=?", str({"+": a + b, "-": a - b, "*": a * b}[op])
    defaults = {"reverse": {"min_len": 3, "max_len": 5, "alphabet": "abcdefghij"},
                "count": {"min_len": 4, "max_len": 8, "alphabet": "abc"}}[dataset]
    cfg = {**defaults, **config}
    length = cfg["min_len"] + rng.below(cfg["max_len"] - cfg["min_len"] + 1)
    word = "".join(rng.pick(cfg["alphabet"]) for _ in range(length))
    if dataset == "reverse":
        return f"reverse {word}", word[::-1]
    letter = rng.pick(cfg["alphabet"])
    return f"count {letter} in {word}", str(word.count(letter))


@pytest.mark.parametrize("case", VECTORS["tasks"], ids=lambda c: f"{c['dataset']}-{c['index']}")
def test_each_task_vector_is_what_the_code_and_the_spec_generate(case):
    ref = (case["dataset"], case["config"], case["seed"], case["index"])
    task = regenerate(TaskRef(*ref))
    assert (task.question, task.answer) == (case["question"], case["answer"])
    assert spec_task(*ref) == (case["question"], case["answer"])


def test_the_spec_generator_matches_the_code_beyond_the_vectors():
    for index in range(300):
        for dataset, config in (("arith", {"max_operand": 1000, "ops": "+-*"}), ("arith", {"max_operand": 9, "max_second": 99, "ops": "*"}),
                                ("reverse", {"max_len": 9}),
                                ("count", {"alphabet": "wxyz"})):
            task = regenerate(TaskRef(dataset, config, index % 5 - 2, index))
            assert spec_task(dataset, config, index % 5 - 2, index) == (task.question, task.answer)
