"""Benchmark results: derived metrics, and the JSON / markdown / PNG files they are written to."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# docs/design.md §6 targets.
TARGET_VS_FLEX = 1.2
TARGET_VS_SDPA_FLASH = 1.0
TARGET_DENSITY_SLACK = 1.15
TERA = 1e12
MS_PER_S = 1e3


def tflops(flops: float, ms: float | None) -> float | None:
    if ms is None or ms <= 0:
        return None
    return flops / (ms / MS_PER_S) / TERA


def add_density_ratios(records: Sequence[dict[str, Any]], ours: str) -> None:
    """time(sparse) / time(dense causal) of the same problem, next to the block-count ratio."""
    baseline: dict[tuple, float] = {}
    for r in records:
        ms = r["results"].get(ours, {}).get("median_ms")
        if r["case"]["pattern"]["label"] == "dense-causal" and ms:
            baseline[tuple(r["problem_key"])] = ms
    for r in records:
        ms = r["results"].get(ours, {}).get("median_ms")
        base = baseline.get(tuple(r["problem_key"]))
        if ms and base:
            r["time_vs_dense_causal"] = ms / base
            r["density_target_met"] = ms / base <= TARGET_DENSITY_SLACK * r["density_vs_causal"]


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def markdown_table(report: dict[str, Any]) -> str:
    ours = report["ours"]
    peers = report["peers"]
    header = (
        ["pattern", "T", "d", "dtype", "b", "dir", "density/causal", f"{ours} ms", "TFLOP/s"]
        + [f"x {p}" for p in peers]
        + ["t/t_causal", "peak MiB", "ok"]
    )
    lines = [
        f"# cuattn benchmark, {report['date']}, {report['device']}",
        "",
        f"timer: {report['timer']}; median of {report['repeats']} runs after {report['warmup']}"
        " warm-up runs; TFLOP/s count computed blocks only; `x peer` = peer time / our time"
        " (> 1 means cuattn is faster).",
        f"forward kernels: {report.get('kernels', 'mma')} (CUATTN_KERNELS; auto: attn_fwd_sm90"
        " where it applies on sm_90, else attn_fwd).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for r in report["records"]:
        case = r["case"]
        mine = r["results"].get(ours, {})
        row = [
            case["pattern"]["label"],
            str(case["n_ctx"]),
            str(case["head_dim"]),
            case["dtype"],
            str(case["blocksize"]),
            case["direction"],
            _fmt(r.get("density_vs_causal"), ".3f"),
            _fmt(mine.get("median_ms"), ".3f"),
            _fmt(mine.get("tflops")),
        ]
        for p in peers:
            row.append(_fmt(r.get("speedup", {}).get(p), ".2f"))
        peak = mine.get("peak_bytes")
        row += [
            _fmt(r.get("time_vs_dense_causal"), ".3f"),
            _fmt(None if peak is None else peak / 2**20),
            "yes" if r.get("correct") else ("skip" if r.get("correct") is None else "NO"),
        ]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Targets (docs/design.md §6):", *(f"* {line}" for line in target_summary(report))]
    skipped = sorted({f"{p}: {why}" for r in report["records"] for p, why in r["skipped"].items()})
    if skipped:
        lines += ["", "Not measured:", *(f"* {s}" for s in skipped)]
    return "\n".join(lines) + "\n"


def _target_line(label: str, checks: list[tuple[str, float, bool]]) -> str:
    if not checks:
        return f"{label}: not measured"
    met = sum(ok for _, _, ok in checks)
    worst_name, worst_value, _ = min(checks, key=lambda c: c[1])
    return f"{label}: {met}/{len(checks)} met; lowest {worst_value:.2f} ({worst_name})"


def target_summary(report: dict[str, Any]) -> list[str]:
    """One line per §6 target: how many cases meet it and the worst case."""
    vs_flash, vs_flex, density = [], [], []
    for r in report["records"]:
        case, speedup = r["case"], r.get("speedup", {})
        label = case["pattern"]["label"]
        if label == "dense-causal" and case["dtype"] == "bfloat16" and case["n_ctx"] >= 2048:
            if "sdpa-flash" in speedup:
                value = speedup["sdpa-flash"]
                vs_flash.append((r["name"], value, value >= TARGET_VS_SDPA_FLASH))
        if case["pattern"]["mode"] != "all" and "flex" in speedup:
            vs_flex.append((r["name"], speedup["flex"], speedup["flex"] >= TARGET_VS_FLEX))
        if "density_target_met" in r and label != "dense-causal":
            # headroom: allowed time ratio over measured time ratio (>= 1 means met)
            allowed = TARGET_DENSITY_SLACK * r["density_vs_causal"]
            headroom = allowed / r["time_vs_dense_causal"]
            density.append((r["name"], headroom, r["density_target_met"]))
    return [
        _target_line(f"dense causal bf16 T>=2k: >= {TARGET_VS_SDPA_FLASH}x SDPA-flash", vs_flash),
        _target_line(f"sparse patterns: >= {TARGET_VS_FLEX}x compiled FlexAttention", vs_flex),
        _target_line(
            f"t/t_causal <= {TARGET_DENSITY_SLACK} x density ratio (value: allowed/measured)",
            density,
        ),
    ]


def plot_speed_vs_density(report: dict[str, Any], path: Path) -> bool:
    """PNG of TFLOP/s (computed blocks) against density; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in [report["ours"], *report["peers"]]:
        points = [
            (r["density_vs_causal"], r["results"][name]["tflops"])
            for r in report["records"]
            if r["results"].get(name, {}).get("tflops")
        ]
        if points:
            x, y = zip(*points, strict=True)
            ax.scatter(x, y, label=name, s=14)
    ax.set_xscale("log")
    ax.set_xlabel("active blocks / dense causal blocks")
    ax.set_ylabel("TFLOP/s (computed blocks)")
    ax.set_title(f"cuattn vs peers, {report['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def rows_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A markdown table of flat rows (floats to 3 decimals), columns in the first row's order."""
    columns = list(columns or rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        cells = [f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_rows(rows: Iterable[dict[str, Any]], markdown: Path | None) -> list[dict[str, Any]]:
    """Each row printed as a JSON line as soon as it is measured (kept should a time limit cut
    the run), then the whole markdown table, printed and written to ``markdown`` if given."""
    done = []
    for row in rows:
        done.append(row)
        print(json.dumps(row, default=str), flush=True)
    table = rows_table(done)
    print(table)
    if markdown:
        markdown.write_text(table + "\n")
    return done
