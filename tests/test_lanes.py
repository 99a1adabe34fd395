"""scripts/test.sh's two lanes (tests/conftest.py): the slow tests one after another in one pytest-xdist worker,
the quick ones beside them in the other."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests import conftest
from tests.conftest import ROOT


@pytest.mark.slow
def test_every_slow_test_runs_in_one_worker_and_no_quick_or_untimed_test_is_held_to_it(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: end-to-end\n    untimed: no bound\n    long: minutes\n")
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_addoption, pytest_collection_modifyitems, pytest_configure  # noqa: F401\n")
    (tmp_path / "test_mixed.py").write_text(
        "import pytest\n\n\n"
        "@pytest.mark.slow\n@pytest.mark.parametrize('k', range(4))\ndef test_slow(k):\n    pass\n\n\n"
        "@pytest.mark.slow\n@pytest.mark.untimed\n@pytest.mark.parametrize('k', range(2))\ndef test_untimed(k):\n    pass\n\n\n"
        "@pytest.mark.parametrize('k', range(6))\ndef test_quick(k):\n    pass\n\n\n"
        "@pytest.mark.slow\n@pytest.mark.long\ndef test_long():\n    pass\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-v",
                        "--rootdir", str(tmp_path), "-c", str(tmp_path / "pytest.ini"), str(tmp_path)],
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ran = re.findall(r"\[(gw\d)\] \[\s*\d+%\] PASSED \S+::(test_\w+)\[\d\](@\w+)?", r.stdout)
    assert len(ran) == 12 and "2 workers [12 items]" in r.stdout, r.stdout  # of 13: a `long` test runs only with --long
    slow = {(worker, group) for worker, name, group in ran if name == "test_slow"}
    assert len(slow) == 1 and next(iter(slow))[1] == "@slow", ran
    assert all(group == "" for _, name, group in ran if name != "test_slow"), ran  # quick or untimed: either lane


def test_a_pytest_whose_node_ids_cannot_be_grouped_is_refused_in_one_line(monkeypatch):
    config = SimpleNamespace(getoption=lambda name, default=None: "loadgroup")
    monkeypatch.setattr(pytest, "__version__", "9.2.0")
    with pytest.raises(pytest.UsageError, match=r"^pytest 9\.2\.0: pytest-xdist's --dist loadgroup does not group"):
        conftest.pytest_configure(config)
    monkeypatch.setattr(pytest, "__version__", "9.1.1")
    conftest.pytest_configure(config)  # grouped as asked
