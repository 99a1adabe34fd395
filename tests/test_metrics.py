"""The metrics log: a line a round, set aside on resume and rotated into compressed archives, losing nothing."""

import gzip
import json
import logging

from node.metrics import MetricsLog, RoundMetrics


def row(r: int, accuracy: float | None = None) -> RoundMetrics:
    return RoundMetrics(round=r, time=float(r), reward_mean=0.5, accuracy_train=0.5, eval_accuracy=accuracy, n_local=1,
                        n_external=0, tokens_generated=10, seconds_generate=0, seconds_train=0, seconds_other=0)


def rounds(rows: list[dict]) -> list[int]:
    return [r["round"] for r in rows]


def written(tmp_path, n: int, rotate_bytes: int | None) -> MetricsLog:
    log = MetricsLog(tmp_path / "metrics.jsonl", rotate_bytes=rotate_bytes)
    for r in range(n):
        log.append(row(r, accuracy=0.25 if r == 0 else None))
    return log


def test_metrics_rewind_sets_later_rounds_aside(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for r in range(5):
        log.append(RoundMetrics(round=r, time=0, reward_mean=0, accuracy_train=0, eval_accuracy=None, n_local=1,
                                n_external=0, tokens_generated=0, seconds_generate=0, seconds_train=0, seconds_other=0))
    with open(log.path, "a") as f:
        f.write('{"round": 5, "tim')  # torn by a crash
    assert log.rewind(2) == 3
    assert [json.loads(x)["round"] for x in log.path.read_text().splitlines()] == [0, 1, 2]
    assert len((tmp_path / "metrics.rolled-back.jsonl").read_text().splitlines()) == 3


def test_metrics_rewind_sets_lines_that_are_not_a_rounds_aside_byte_for_byte(tmp_path, caplog):
    """A list, a round that is not a number and bytes that are not UTF-8 ended a resume in a traceback."""
    log = MetricsLog(tmp_path / "metrics.jsonl")
    strange = [b"[1, 2, 3]", b'{"round": "x"}', b'{"round": true}', b"\xff\xfe not utf-8"]
    log.path.write_bytes(b'{"round": 0}\n' + b"\n".join(strange) + b'\n{"round": 1}\n{"round": 2}\n')
    with caplog.at_level(logging.WARNING):
        assert log.rewind(1) == 5
    assert log.path.read_bytes() == b'{"round": 0}\n{"round": 1}\n'
    assert (tmp_path / "metrics.rolled-back.jsonl").read_bytes() == b"\n".join([*strange, b'{"round": 2}']) + b"\n"
    assert caplog.messages == ["moved 5 metrics lines after round 1 to metrics.rolled-back.jsonl (4 of them not a "
                               "round's line)"]


def test_past_its_size_the_file_moves_to_compressed_archives_byte_for_byte(tmp_path):
    plain = written(tmp_path / "plain", 10, rotate_bytes=None)
    log = written(tmp_path / "rotated", 10, rotate_bytes=1200)  # a line is about 1 KB: an archive every 2 rounds
    archives = log.archives()
    assert [(first, last) for first, last, _ in archives] == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)]
    assert log.path.read_bytes() == b""
    joined = b"".join(gzip.decompress(p.read_bytes()) for *_, p in archives)
    assert joined == plain.path.read_bytes()
    assert log.rows() == plain.rows() and rounds(log.rows()) == list(range(10))
    assert log.start_row()["eval_accuracy"] == 0.25


def test_a_resume_from_before_an_archive_sets_its_later_rounds_aside(tmp_path):
    log = written(tmp_path, 10, rotate_bytes=2500)  # archives of rounds 0-2, 3-5, 6-8; round 9 in the file
    assert [(f, l) for f, l, _ in log.archives()] == [(0, 2), (3, 5), (6, 8)]
    assert log.rewind(4) == 5
    assert [(f, l) for f, l, _ in log.archives()] == [(0, 2), (3, 4)]
    assert rounds(log.rows()) == [0, 1, 2, 3, 4]
    aside = [json.loads(x)["round"] for x in (tmp_path / "metrics.rolled-back.jsonl").read_text().splitlines()]
    assert sorted(aside) == [5, 6, 7, 8, 9]
    log.append(row(5))
    assert rounds(log.rows()) == [0, 1, 2, 3, 4, 5]
    assert log.rewind(-1) == 6 and log.rows() == [] and log.archives() == []


def test_a_crash_between_archiving_and_emptying_the_file_leaves_no_round_twice(tmp_path):
    log = written(tmp_path, 4, rotate_bytes=None)
    lines = log.path.read_bytes()
    log.rotate_bytes = 1
    log.append(row(4))  # archived as rounds 0-4, the file emptied
    log.path.write_bytes(lines + json.dumps(row(4).__dict__).encode() + b"\n")  # as if the emptying never happened
    assert rounds(log.rows()) == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert log.rewind(4) == 0
    assert rounds(log.rows()) == [0, 1, 2, 3, 4] and log.path.read_bytes() == b""
    assert not (tmp_path / "metrics.rolled-back.jsonl").exists()


def test_a_crash_while_an_archive_is_rewritten_keeps_the_shorter_one(tmp_path):
    log = written(tmp_path, 6, rotate_bytes=None)
    lines = log.path.read_bytes().splitlines(keepends=True)
    (tmp_path / "metrics.0-5.jsonl.gz").write_bytes(gzip.compress(b"".join(lines)))  # the old archive
    (tmp_path / "metrics.0-3.jsonl.gz").write_bytes(gzip.compress(b"".join(lines[:4])))  # its rewrite
    log.path.write_bytes(b"")
    log.rewind(3)
    assert [(f, l) for f, l, _ in log.archives()] == [(0, 3)]
    assert rounds(log.rows()) == [0, 1, 2, 3]


def test_an_archive_that_is_not_gzip_is_one_error_naming_it_and_nothing_changes(tmp_path):
    import pytest

    from node.metrics import MetricsError

    log = written(tmp_path, 6, rotate_bytes=2500)
    (tmp_path / "metrics.0-2.jsonl.gz").write_bytes(b"junk")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(MetricsError, match=r"metrics archive .*metrics\.0-2\.jsonl\.gz cannot be read .*move it aside"):
        log.rewind(1)
    with pytest.raises(MetricsError):
        log.rows()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
