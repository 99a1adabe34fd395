import json

import pytest
import torch

from trainer import checkpoint


def save(policy, directory, round_, keep=3):
    return checkpoint.save(directory, round_, policy.model, policy.tokenizer, {"x": torch.arange(3)}, {"task_position": round_ * 8}, keep)


def test_round_trip(policy, tmp_path):
    save(policy, tmp_path, 7)
    ckpt = checkpoint.load_latest(tmp_path)
    assert ckpt.round == 7 and ckpt.state["task_position"] == 56
    assert torch.equal(ckpt.trainer_state["x"], torch.arange(3))
    assert (ckpt.model_dir / "config.json").exists() and (ckpt.model_dir / "tokenizer.json").exists()


def test_keeps_only_the_newest_k(policy, tmp_path):
    for r in (1, 2, 3, 4, 5):
        save(policy, tmp_path, r, keep=2)
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["round-000004", "round-000005"]


def test_an_interrupted_write_is_ignored_and_cleared(policy, tmp_path):
    save(policy, tmp_path, 3)
    torn = tmp_path / ".round-000004.tmp"
    (torn / "model").mkdir(parents=True)
    assert checkpoint.load_latest(tmp_path).round == 3
    save(policy, tmp_path, 4)
    assert not torn.exists()
    assert checkpoint.load_latest(tmp_path).round == 4


@pytest.mark.parametrize("failure", [RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 910320960"),
                                     OSError(28, "No space left on device")])
def test_a_checkpoint_that_cannot_be_written_is_a_clear_error_and_the_last_one_stands(policy, tmp_path, monkeypatch,
                                                                                       failure):
    """A full disk made torch.save raise mid-write: the node died with a traceback and left a torn folder."""
    save(policy, tmp_path, 3)

    def full_disk(obj, path):
        path.write_bytes(b"partial")
        raise failure

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    with pytest.raises(checkpoint.CheckpointError, match=r"^cannot write checkpoint .*round-000004 \((RuntimeError|OSError): "
                                                         r".*GB free on its disk\); the last complete checkpoint is kept$"):
        save(policy, tmp_path, 4)
    assert not (tmp_path / ".round-000004.tmp").exists()  # the partial write is cleared, freeing its space
    assert checkpoint.load_latest(tmp_path).round == 3


def test_saving_the_same_round_twice_replaces_it(policy, tmp_path):
    save(policy, tmp_path, 3)
    save(policy, tmp_path, 3)
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["round-000003"]


def test_an_unreadable_latest_checkpoint_is_a_clear_error_and_is_not_deleted(policy, tmp_path):
    save(policy, tmp_path, 1)
    path = save(policy, tmp_path, 2)
    (path / "state.json").write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match="round-000002"):
        checkpoint.load_latest(tmp_path)
    assert path.exists()


@pytest.mark.parametrize("edit, problem", [
    (lambda state, trainer: state.pop("task_position"), "no state.json task_position"),
    (lambda state, trainer: trainer.pop("optimizer"), "no trainer.pt optimizer"),
    (lambda state, trainer: state.update(round=50), "state.json says round 50"),
    (lambda state, trainer: state.update(round="2"), "state.json says round '2'"),
])
def test_a_checkpoint_missing_what_a_resume_reads_is_unreadable_not_a_key_error(policy, tmp_path, edit, problem):
    """A state.json or trainer.pt edited or cut short ended a resume in a KeyError traceback, and a round in
    state.json that is not the folder's resumed at that round."""
    path = save(policy, tmp_path, 2)
    state = json.loads((path / "state.json").read_text())
    trainer = {**torch.load(path / "trainer.pt", weights_only=False), "optimizer": {}}
    edit(state, trainer)
    (path / "state.json").write_text(json.dumps(state))
    torch.save(trainer, path / "trainer.pt")
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load_latest(tmp_path, ("task_position",), ("optimizer",))
    assert str(e.value) == f"checkpoint {path} is unreadable ({problem}); move it aside to resume from an older one"


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    assert checkpoint.load_latest(tmp_path / "missing") is None
    assert json.dumps(checkpoint.complete(tmp_path)) == "[]"
