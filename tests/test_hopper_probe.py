"""scripts/hopper_probe.py on the CPU interpreter, so that the script a GPU run starts with
cannot rot: every probe group runs (each in its own process, as on a GPU) and agrees with the
documented layouts, and a difference is reported and fails the run.

    python -m pytest -n 0 tests/test_hopper_probe.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.scripts import SCRIPTS, load_script

pytest.importorskip("ml_dtypes")

REPO = SCRIPTS.parent
SCRIPT = SCRIPTS / "hopper_probe.py"
# Probes per group: wgmma 2 types x 3 widths x 2 operand kinds x 2 forms; TMA 4 swizzle modes x
# 3 positions; the pipeline's data and test_wait; the trap; the rank-4 load at 2 positions; the
# named-barrier turns and the setmaxnreg hand-over; the ordered bulk reduce's sum and counters.
EXPECTED_PROBES = 24 + 12 + 2 + 1 + 2 + 2 + 2


@pytest.fixture(scope="module")
def probe():
    return load_script("hopper_probe")


def test_every_probe_agrees_with_the_documented_layouts_on_the_interpreter(tmp_path):
    report = tmp_path / "probe.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--interp", str(report)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(report.read_text())
    assert summary["devices"] == ["CPU interpreter"]
    assert summary["failed"] == []
    assert summary["passed"] == len(summary["probes"]) == EXPECTED_PROBES


def test_a_wrong_expectation_is_reported_with_its_first_differences(probe, monkeypatch):
    """The pipeline probe against a test_wait expectation turned around: it fails and names
    the entries, as a GPU that disagreed with the emulator would."""
    monkeypatch.setattr(probe, "PIPELINE_OBSERVED", [1, 0, 0, 1])
    device = probe.Interpreter([probe.PIPELINE_EXPRESSION])
    data, observed = probe.probe_pipeline(device)
    assert data["pass"]
    assert not observed["pass"]
    assert observed["differing"] == 4
    assert observed["first_differences"][0] == {"index": (0,), "got": 0, "expected": 1}


def test_an_accumulator_in_the_wrong_place_is_named_by_row_and_column(probe):
    """What the report says when a GPU's fragment differs: the documented place of the register
    and, with the index operands, the element of D that landed there."""
    rows, columns = probe.accumulator_positions(64)
    expected = (probe.INDEX_SCALE * rows + columns).astype(np.float32)
    got = expected.copy()
    got[5, 2] = probe.INDEX_SCALE * 9 + 33
    entry = probe.compare("index", got, expected, probe.wgmma_describer(rows, columns, "index"))
    assert not entry["pass"]
    (first,) = entry["first_differences"]
    assert first["index"] == (5, 2)
    assert first["documented_row_column"] == [int(rows[5, 2]), int(columns[5, 2])]
    assert first["got_row_column"] == [9, 33]


def test_nan_never_agrees(probe):
    entry = probe.compare("nan", np.full(3, np.nan, np.float32), np.full(3, np.nan, np.float32))
    assert not entry["pass"] and entry["differing"] == 3


def test_any_failed_probe_makes_the_run_fail(probe, monkeypatch, tmp_path):
    failing = {
        "devices": ["x"],
        "passed": 0,
        "failed": ["p"],
        "probes": [{"probe": "p", "pass": False}],
    }
    monkeypatch.setattr(probe, "run_all", lambda use_interpreter, timeout_s: failing)
    assert probe.main(["--interp", str(tmp_path / "r.json")]) == 1
    assert json.loads((tmp_path / "r.json").read_text())["failed"] == ["p"]
