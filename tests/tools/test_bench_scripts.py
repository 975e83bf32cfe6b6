"""The GPU benchmark scripts run end to end on the CPU (their --smoke modes), so they do not rot
between GPU sessions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "script, extra, column",
    [
        ("dynamic_bench.py", ["--smoke"], "topk_select_ms"),
        ("decode_bench.py", ["--smoke", "--policies", "full"], "kernel_ms"),
        (  # paged_decode over the full cache's tokens in vLLM's layout, bf16 and fp8 pages
            "decode_bench.py",
            ["--smoke", "--policies", "full", "--pages", "float8_e4m3fn"],
            "| float8_e4m3fn | paged_decode |",
        ),
        ("decode_bench.py", ["--smoke", "--policies", "quest"], "choice_ms"),
        (
            "decode_bench.py",
            ["--smoke", "--policies", "full", "--decode", "gqa", "--t-q", "4", "--page", "16"],
            "attn_decode_gqa",
        ),
        (
            "cp_bench.py",
            ["--n", "256", "--world", "2", "--patterns", "causal", "--project"],
            "ring_ms",
        ),
    ],
)
def test_smoke(script, extra, column, tmp_path):
    table = tmp_path / "table.md"
    command = [sys.executable, str(ROOT / "scripts" / script), "--markdown", str(table), *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = table.read_text().splitlines()
    assert any(column in line for line in lines) and len(lines) > 2
