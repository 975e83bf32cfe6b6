"""The command line: `cuattn check` passes and prints its table; `cuattn show` draws layouts."""

import io
import subprocess
import sys

import pytest

import cuattn
from cuattn.backends.geometry import HEAD_DIMS
from cuattn.tools import check
from cuattn.tools.cli import main


def test_check_quick_on_numpy_prints_a_passing_table():
    out = io.StringIO()
    assert check.main(backend="numpy", size="quick", out=out) == 0
    text = out.getvalue()
    lines = text.splitlines()
    total = len(list(check.cases("numpy", "quick")))
    assert lines[0].startswith("cuattn check: backend numpy (chosen with --backend); quick sweep")
    assert f"{total} cases, about" in lines[0]
    assert lines[1].split()[:3] == ["pattern", "shape", "[B,H,T,D]"]
    rows = [ln for ln in lines if ln.endswith(" ok") or ln.endswith("FAIL")]
    assert len(rows) == total and rows[0].startswith(f"[ 1/{total}]")
    assert all(r.endswith(" ok") for r in rows)
    assert lines[-1] == f"PASS: {total} passed, 0 failed"
    assert any(ln.strip().startswith("float16   worst relative error") for ln in lines)
    patterns = {r.split("] ", 1)[1].split("  ")[0].strip() for r in rows}
    assert {
        "all",
        "local",
        "strided",
        "fixed",
        "longformer",
        "bigbird",
        "variable",
        "custom",
        check.DECODE_PATTERN,
    } <= patterns
    # the decode case has no backward: its column says so instead of a number
    decode_rows = [r for r in rows if check.DECODE_PATTERN in r]
    assert decode_rows and all(r.split()[-2] == "-" for r in decode_rows)


def test_check_reports_a_failure(monkeypatch):
    monkeypatch.setattr(check, "run_case", lambda case, backend: (float("nan"), 0.0))
    out = io.StringIO()
    assert check.main(backend="numpy", size="quick", out=out) == 1
    lines = out.getvalue().splitlines()
    assert lines[-1].startswith("FAIL: 0 passed")
    assert any("worst relative error inf" in ln for ln in lines)


def test_check_picks_its_sweep_by_backend_and_says_why(monkeypatch):
    """A plain `cuattn check` on a CPU-only machine runs the interpreter's quick sweep (under a
    minute on 2 cores); --standard covers head dims 32-128, 96 included; --full every one."""
    monkeypatch.setattr(check.shutil, "which", lambda name: "/usr/bin/g++")
    monkeypatch.setitem(__import__("sys").modules, "cupy", None)
    backend, why = check.best_backend()
    assert backend == "interp" and "g++" in why
    monkeypatch.setattr(check, "run_case", lambda case, backend: (0.0, 0.0))
    out = io.StringIO()
    assert check.main(out=out) == 0
    first = out.getvalue().splitlines()[0]
    assert first.startswith("cuattn check: backend interp (") and "quick sweep" in first
    assert {c.head_dim for c in check.cases("numpy", "standard")} == {32, 64, 96, 128}
    assert {c.head_dim for c in check.cases("numpy", "full")} == set(HEAD_DIMS)


def test_show_fixed_prints_per_head_pictures(capsys, tmp_path):
    png = tmp_path / "fixed.png"
    argv = ["show", "fixed", "--local-attn-ctx", "128", "--num-verts", "4", "--vertsize", "1"]
    assert main([*argv, "--png", str(png)]) == 0
    text = capsys.readouterr().out
    assert [line for line in text.splitlines() if line.startswith("head ")] == [
        f"head {h}" for h in range(4)
    ]
    assert "█" in text and "legend:" in text
    assert png.stat().st_size > 1000


def test_show_tells_strided_from_causal_by_its_legend_and_element_picture(capsys):
    """Both fill the lower block triangle with partial blocks at these sizes; the element picture
    of the first tokens shows strided's diagonals beside causal's filled triangle."""
    common = ["--n-ctx", "64", "--blocksize", "16", "--heads", "1", "--zoom", "12"]
    pictures = {}
    for mode in ("strided", "all"):
        assert main(["show", mode, "--local-attn-ctx", "4", *common]) == 0
        text = capsys.readouterr().out
        assert "legend:" in text and "░ some pairs" in text
        pictures[mode] = text.split("elements:", 1)[1].splitlines()[1:]
    assert pictures["all"][5] == "██████······"
    assert pictures["strided"][5] == "·█···█······"  # keys 1 and 5: distances 4 and 0
    assert main(["show", "all", *common[:-2], "--zoom", "0"]) == 0
    assert "elements:" not in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"cuattn {cuattn.__version__}"


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
    second = out.getvalue().splitlines()[1]
    assert second.startswith("bfloat16 cases skipped: pip install ml_dtypes")
    monkeypatch.setattr(check, "_has_bfloat16", lambda: True)
    assert any(c.dtype == "bfloat16" for c in check.cases("interp", "quick"))


def test_check_cuda_without_a_device_says_so_in_one_line(monkeypatch, capsys):
    """--backend cuda on a machine without a GPU: one line naming why, a non-zero exit, and no
    estimate, no case, no CuPy traceback."""
    monkeypatch.setattr(check, "no_cuda_device", lambda: "no CUDA driver or device")
    monkeypatch.setattr(check, "run_case", lambda case, backend: pytest.fail("a case ran"))
    out = io.StringIO()
    assert check.main(backend="cuda", out=out) == check.EXIT_NO_DEVICE != 0
    assert out.getvalue() == ""
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--backend cuda needs a CUDA device" in err[0]
    assert "no CUDA driver or device" in err[0] and "about" not in err[0]


@pytest.mark.skipif(check.no_cuda_device() is None, reason="this machine has a CUDA device")
def test_check_cuda_without_a_device_from_the_command_line():
    res = subprocess.run(
        [sys.executable, "-m", "cuattn", "check", "--backend", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == check.EXIT_NO_DEVICE, res.stderr
    assert res.stdout == "" and len(res.stderr.splitlines()) == 1
    assert "needs a CUDA device" in res.stderr and "Traceback" not in res.stderr
