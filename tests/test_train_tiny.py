"""scripts/train_tiny.py runs, its loss falls, and it reports recompute's saving."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_tiny.py"
SMOKE_STEPS = "12"


def test_train_tiny_smoke(capsys):
    spec = importlib.util.spec_from_file_location("train_tiny", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--steps", SMOKE_STEPS, "--batch", "4"]) == 0
    printed = capsys.readouterr().out
    assert "with recompute (saves" in printed
    assert f"in {SMOKE_STEPS} steps" in printed
