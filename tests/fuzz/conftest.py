"""Prints the differential fuzzer's case counts (tests/fuzz/test_differential.py STATS)."""

import sys


def pytest_terminal_summary(terminalreporter):
    module = sys.modules.get("tests.fuzz.test_differential")
    stats = getattr(module, "STATS", None)
    if not stats:
        return
    terminalreporter.section("cuattn differential fuzzer")
    total = sum(v for k, v in stats.items() if not k.split("/")[-1].startswith("known:"))
    terminalreporter.write_line(f"{total} cases checked")
    for key in sorted(stats):
        terminalreporter.write_line(f"  {stats[key]:6d}  {key}")
    ratios = getattr(module, "RATIOS", {})
    if ratios:
        terminalreporter.write_line("largest error / max(same-precision dense error, eps):")
        for (name, eps), r in sorted(ratios.items()):
            terminalreporter.write_line(f"  {name:4s} eps={eps:.3g}: {r:.3f}")
