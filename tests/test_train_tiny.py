"""scripts/train_tiny.py runs, its loss falls, and it reports recompute's saving."""

from __future__ import annotations

from tests.helpers.scripts import load_script

SMOKE_STEPS = "12"


def test_train_tiny_smoke(capsys):
    module = load_script("train_tiny")
    assert module.main(["--steps", SMOKE_STEPS, "--batch", "4"]) == 0
    printed = capsys.readouterr().out
    assert "with recompute (saves" in printed
    assert f"in {SMOKE_STEPS} steps" in printed


def test_train_with_blocks_chosen_every_step(capsys):
    assert (
        load_script("train_tiny").main(
            ["--steps", SMOKE_STEPS, "--batch", "4", "--pattern", "topk"]
        )
        == 0
    )
    assert f"in {SMOKE_STEPS} steps" in capsys.readouterr().out


def test_compare_tabulates_and_plots_every_pattern(tmp_path):
    table, plot = tmp_path / "t.md", tmp_path / "p.png"
    args = ["--compare", "--steps", "3", "--batch", "2", "--markdown", str(table)]
    assert load_script("train_tiny").main([*args, "--png", str(plot)]) == 0
    rows = table.read_text().splitlines()[4:]
    assert [r.split("|")[1].strip() for r in rows] == ["fixed", "dense", "topk"]
    assert plot.stat().st_size > 0
