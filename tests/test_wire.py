"""Wire protocol v2: codec, splitting under the limits, and one test per rejection reason."""

from __future__ import annotations

import time

import msgpack
import pytest

from libp2p.peer.id import ID

from p2p.config import Limits, P2PConfig
from p2p.policy import MessagePolicy
from p2p.shards import EPOCH_S, epoch_of, prefix, shard_key, shard_topic
from rewards import TaskRef, regenerate
from rewards.scoring import group_carries_signal
from p2p.wire import REASONS, VERSION, Rejected, WireGroup, WireMessage, decode, encode, pack_groups

ME = "12D3KooWAuthorAuthorAuthorAuthorAuthorAuthorAuthorAu"
NOW = 1_800_000_000.0
BASE = P2PConfig().rollout_topic_base()


def topics_of(author: str, now: float) -> list[str]:
    """The topic ids of `author`'s message to level 0 at unix time `now` (every author's level-0 shard)."""
    return [shard_topic(BASE, shard_key(ID.from_base58(author).to_bytes(), epoch_of(now, EPOCH_S)), 0)]


TOPICS = topics_of(ME, NOW)


def group(index: int = 0, n: int = 8, chars: int = 20) -> WireGroup:
    """The task's right answer, then n - 1 wrong ones: a group any receiver can learn from."""
    answers = [regenerate(TaskRef("arith", {"max_operand": 9}, 3, index)).answer, *(f"x{i}" for i in range(1, n))]
    return WireGroup(dataset="arith", config={"max_operand": 9}, seed=3, index=index,
                     completions=[f"<answer>{a}</answer>".rjust(chars, ".") for a in answers])


def raw_message(**changes) -> dict:
    msg = {"v": VERSION, "peer": ME, "model": "tiny-a", "round": 4, "created": NOW,
           "groups": [group().model_dump()]}
    msg.update(changes)
    return msg


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_a_message_round_trips_and_unknown_fields_are_ignored():
    msg = WireMessage.model_validate(raw_message())
    assert decode(encode(msg), Limits()) == msg
    newer = decode(pack(raw_message(signature_v2="x", groups=[{**group().model_dump(), "hint": 1}])), Limits())
    assert newer.groups[0] == group()


def test_pack_groups_splits_under_the_byte_and_group_caps_and_leaves_out_only_impossible_groups():
    limits = Limits(max_message_bytes=4096, max_groups=3)
    groups = [group(i, n=8, chars=40) for i in range(20)] + [group(99, n=8, chars=2000)]
    payloads, skipped = pack_groups(ME, "tiny-a", 1, NOW, groups, limits)
    assert skipped == 1  # 8 x 2000 chars cannot fit 4096 bytes
    decoded = [decode(p, limits) for p in payloads]
    assert all(len(p) <= limits.max_message_bytes for p in payloads)
    assert all(len(m.groups) <= 3 for m in decoded)
    assert [g.index for m in decoded for g in m.groups] == list(range(20))


def test_group_key_ignores_completion_order_but_not_content():
    g = group()
    shuffled = g.model_copy(update={"completions": list(reversed(g.completions))})
    assert g.key() == shuffled.key()
    assert g.key() != group(index=1).key()


def not_my_shard(author: str, now: float) -> str:
    """A level-2 shard topic that `author`'s key falls in neither this epoch nor a neighbouring one."""
    keys = [shard_key(ID.from_base58(author).to_bytes(), epoch_of(now, EPOCH_S) + d) for d in (-1, 0, 1)]
    return f"{BASE}/s" + next(b for b in ("00", "01", "10", "11") if b not in {prefix(k, 2) for k in keys})


def bad_payloads(author: str, now: float) -> dict[str, tuple[bytes, list[str]]]:
    """reason -> (payload, topic ids): every class a receiver can see from the signer `author`; each
    must be rejected and counted."""
    def msg(**changes) -> bytes:
        return pack(raw_message(**{"peer": author, "created": now, **changes}))
    other = "12D3KooWSomebodyEsseSomebodyEsseSomebodyEsseSomebod"
    cases = {
        "undecodable": b"\xc1\x00not msgpack",
        "schema": msg(round="four"),
        "version": msg(v=1),
        "too_large": msg(groups=[group(i, n=8, chars=4000).model_dump() for i in range(10)]),
        "too_many_groups": msg(groups=[group(i, n=1).model_dump() for i in range(65)]),
        "too_many_completions": msg(groups=[group(n=65).model_dump()]),
        "completion_too_long": msg(groups=[group(chars=8193).model_dump()]),
        "sender_mismatch": pack(raw_message(peer=other, created=now)),
        "from_future": msg(created=now + 3600),
        "too_old": msg(created=now - 3600),
        "no_signal": msg(groups=[{**group().model_dump(), "completions": ["<answer>3</answer>"] * 4},
                                 {**group(1).model_dump(), "completions": ["no answer", "none either"]}]),
    }
    topics = topics_of(author, now)
    return {**{reason: (data, topics) for reason, data in cases.items()},
            "wrong_shard": (msg(), [*topics, not_my_shard(author, now)])}  # two topics, one not its shard


CASES = bad_payloads(ME, NOW)


def test_every_reason_has_a_case():
    assert set(CASES) | {"duplicate", "over_budget"} == set(REASONS)  # both need a message sent before


@pytest.mark.parametrize("reason", sorted(CASES))
def test_each_bad_message_class_is_rejected_with_its_reason_and_counted(reason):
    policy = MessagePolicy(Limits(), BASE, signal=group_carries_signal)
    data, topics = CASES[reason]
    with pytest.raises(Rejected) as caught:
        policy.check(data, ME, topics, now=NOW)
    assert caught.value.reason == reason
    assert policy.stats() == {"accepted": 0, "rejected": {reason: 1}}


def test_the_same_bytes_twice_are_a_duplicate():
    policy = MessagePolicy(Limits(), BASE, signal=group_carries_signal)
    data = pack(raw_message())
    policy.check(data, ME, TOPICS, now=NOW)
    with pytest.raises(Rejected, match="duplicate"):
        policy.check(data, ME, TOPICS, now=NOW + 1)
    assert policy.stats() == {"accepted": 1, "rejected": {"duplicate": 1}}


def test_an_authors_bytes_past_its_budget_are_refused_charged_once_per_payload_and_refilled_over_time():
    limits = Limits(max_message_bytes=4096, max_author_kib_per_s=1)  # a burst of 8 KiB, then 1 KiB a second
    policy = MessagePolicy(limits, BASE, signal=group_carries_signal)
    other = "12D3KooWSomebodyEsseSomebodyEsseSomebodyEsseSomebod"
    big = [pack(raw_message(round=r, groups=[group(r, chars=300).model_dump()])) for r in range(4)]  # 2.6 KB each
    second_topic = [shard_topic(BASE, shard_key(ID.from_base58(ME).to_bytes(), epoch_of(NOW, EPOCH_S)), 1)]
    for data in big[:3]:
        policy.check(data, ME, TOPICS, now=NOW)
    policy.check(big[0], ME, second_topic, now=NOW)  # the same payload under another of its topics: no charge
    with pytest.raises(Rejected, match="over_budget"):
        policy.check(big[3], ME, TOPICS, now=NOW)
    policy.check(pack(raw_message(peer=other)), other, topics_of(other, NOW), now=NOW)  # its own budget
    policy.check(big[3], ME, second_topic, now=NOW + 3)  # refilled: 3 KiB more
    assert policy.stats() == {"accepted": 6, "rejected": {"over_budget": 1}}


@pytest.mark.parametrize("payload", [pack([1, 2]), pack(raw_message(groups=[])), pack({k: v for k, v in raw_message().items() if k != "v"}),
                                     pack(raw_message(groups=[{**group().model_dump(), "index": -1}])),
                                     pack(raw_message(groups=[{**group().model_dump(), "completions": [1, 2]}]))])
def test_shape_violations_are_schema_errors(payload):
    with pytest.raises(Rejected) as caught:
        decode(payload, Limits())
    assert caught.value.reason == "schema"


def test_a_replay_is_remembered_for_as_long_as_it_could_pass_the_age_check():
    limits = Limits(max_message_age_s=60, max_clock_skew_s=5)
    policy = MessagePolicy(limits, BASE, signal=group_carries_signal)
    data = pack(raw_message(created=NOW))
    policy.check(data, ME, TOPICS, now=NOW)
    with pytest.raises(Rejected, match="duplicate"):
        policy.check(data, ME, TOPICS, now=NOW + 59)
    with pytest.raises(Rejected, match="too_old"):
        policy.check(data, ME, TOPICS, now=NOW + 61)


def test_a_fresh_message_from_its_signer_is_accepted_at_the_real_clock():
    now = time.time()
    msg = MessagePolicy(Limits(), BASE, signal=group_carries_signal).check(pack(raw_message(created=now)), ME, topics_of(ME, now), now=now)
    assert msg.peer == ME and len(msg.groups) == 1


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_number_anywhere_is_a_schema_rejection_and_stays_one(value):
    policy = MessagePolicy(Limits(), BASE, signal=group_carries_signal)
    bad_created = pack(raw_message(created=value))
    bad_config = pack(raw_message(groups=[{**group().model_dump(), "config": {"min_len": value}}]))
    for data in (bad_created, bad_config):
        for now in (NOW, NOW + 400):  # past the duplicate window: still refused, not accepted
            with pytest.raises(Rejected, match="schema: .*not a finite number"):
                policy.check(data, ME, TOPICS, now=now)
    assert policy.stats() == {"accepted": 0, "rejected": {"schema": 4}}


@pytest.mark.parametrize("raw,what", [
    (b"\x82\xa1v\x01\xa1v\x01", "repeats a key"),  # {"v": 1, "v": 1}
    (None, "bytes values"),
    (msgpack.ExtType(5, b"x"), "ExtType values"),
    (msgpack.Timestamp(1), "Timestamp values"),
])
def test_binary_extension_and_repeated_keys_are_not_part_of_the_protocol(raw, what):
    if isinstance(raw, bytes):
        data = raw
    else:
        value = b"\\x00" if raw is None else raw
        data = msgpack.packb(raw_message(groups=[{**group().model_dump(), "config": {"k": value}}]), use_bin_type=True,
                             datetime=False)
    with pytest.raises(Rejected, match=f"schema: .*{what}"):
        decode(data, Limits())


def test_nesting_is_bounded():
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    with pytest.raises(Rejected, match="schema: .*nested deeper than"):
        decode(pack(raw_message(groups=[{**group().model_dump(), "config": {"k": deep}}])), Limits())


def test_a_message_is_forwarded_when_any_group_can_carry_signal():
    right = group(2).completions[0]
    dead = {**group().model_dump(), "completions": ["<answer>3</answer>", " <answer>3</answer>\n"]}
    live = group(1).model_dump()
    half = {**group(2).model_dump(), "completions": [right, "no answer"]}  # right, and a format miss
    gym = {**group(3).model_dump(), "dataset": "rg/leg_counting", "config": {},  # not rebuilt here: answers differ
           "completions": ["<answer>3</answer>", "<answer>4</answer>"]}
    policy = MessagePolicy(Limits(), BASE, signal=group_carries_signal)
    for groups in ([dead, live], [half], [gym]):
        policy.check(pack(raw_message(groups=groups)), ME, TOPICS, now=NOW)
    assert policy.stats() == {"accepted": 3, "rejected": {}}


def test_two_different_wrong_answers_to_a_built_in_task_are_not_forwarded():
    # they passed the answer check, and a one-id flood of them cut a neighbour's rounds per second by a quarter
    g = group()
    wrong = {**g.model_dump(), "completions": ["<answer>x1</answer>", "<answer>x2</answer>"]}
    unbuildable = {**g.model_dump(), "config": {"max_operand": 0}}
    policy = MessagePolicy(Limits(), BASE, signal=group_carries_signal)
    for groups in ([wrong], [unbuildable, wrong]):
        with pytest.raises(Rejected, match="no_signal: none of its"):
            policy.check(pack(raw_message(groups=groups, round=len(groups))), ME, TOPICS, now=NOW)
    assert policy.stats() == {"accepted": 0, "rejected": {"no_signal": 2}}
