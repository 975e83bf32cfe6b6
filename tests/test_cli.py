"""The command line: `cuattn check` passes and prints its table; `cuattn show` draws layouts."""

import io
import subprocess
import sys

import pytest

from cuattn.tools import check
from cuattn.tools.cli import main


def test_check_quick_on_numpy_prints_a_passing_table():
    out = io.StringIO()
    assert check.main(backend="numpy", size="quick", out=out) == 0
    text = out.getvalue()
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["pattern", "shape", "[B,H,T,D]"]
    rows = [ln for ln in lines if ln.endswith(" ok") or ln.endswith("FAIL")]
    assert len(rows) == len(list(check.cases("numpy", "quick")))
    assert all(r.endswith(" ok") for r in rows)
    assert "numpy" in rows[0]
    patterns = {r.split("  ")[0].strip() for r in rows}
    assert {
        "all",
        "local",
        "strided",
        "fixed",
        "longformer",
        "bigbird",
        "variable",
        "custom",
    } <= patterns


def test_check_reports_a_failure(monkeypatch):
    monkeypatch.setattr(check, "run_case", lambda case, backend: (float("nan"), 0.0))
    out = io.StringIO()
    assert check.main(backend="numpy", size="quick", out=out) == 1
    assert "FAIL" in out.getvalue()


def test_show_fixed_prints_per_head_pictures(capsys, tmp_path):
    png = tmp_path / "fixed.png"
    argv = ["show", "fixed", "--local-attn-ctx", "128", "--num-verts", "4", "--vertsize", "1"]
    assert main([*argv, "--png", str(png)]) == 0
    text = capsys.readouterr().out
    assert text.count("head ") == 4 and "█" in text
    assert png.stat().st_size > 1000


def test_show_reports_bad_arguments(capsys):
    assert main(["show", "fixed", "--local-attn-ctx", "100"]) == 2
    assert "multiple of blocksize" in capsys.readouterr().err


@pytest.mark.parametrize(
    "entry", [[sys.executable, "-m", "cuattn"], [sys.executable, "scripts/check.py"]]
)
def test_entry_points_run(entry):
    args = ["show", "local", "--local-attn-ctx", "64", "--n-ctx", "256"]
    if entry[-1].endswith("check.py"):
        args = ["--help"]
    res = subprocess.run([*entry, *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_check_skips_bfloat16_without_ml_dtypes(monkeypatch):
    monkeypatch.setattr(check, "_has_bfloat16", lambda: False)
    assert all(c.dtype != "bfloat16" for c in check.cases("interp", "quick"))
    monkeypatch.setattr(check, "run_case", lambda case, backend: (0.0, 0.0))
    out = io.StringIO()
    assert check.main(backend="interp", size="quick", out=out) == 0
    assert out.getvalue().startswith("bfloat16 cases skipped: pip install ml_dtypes")
    monkeypatch.setattr(check, "_has_bfloat16", lambda: True)
    assert any(c.dtype == "bfloat16" for c in check.cases("interp", "quick"))
