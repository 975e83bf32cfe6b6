"""cuattn generate: the quality-vs-memory table runs, and its rows mean what they say."""

from __future__ import annotations

import argparse

from cuattn.tools import generate


def test_generate_smoke(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args(
        [
            "--steps",
            "3",
            "--windows",
            "1",
            "--markdown",
            str(tmp_path / "t.md"),
            "--png",
            str(tmp_path / "p.png"),
        ]
    )
    assert generate.run(args) == 0
    rows = [line.split("|")[1:-1] for line in (tmp_path / "t.md").read_text().splitlines()[4:]]
    table = {(r[0].strip(), r[1].strip()): r for r in rows}
    per_token = generate.CONFIG.head_dim * 4 * 2 * generate.CONFIG.heads * 2  # layers = 2
    assert float(table[("full cache", "-")][3]) == 1.0  # agrees with itself
    assert int(table[("sliding", "64")][2]) == 64 * per_token  # exactly the budget is kept
    assert int(table[("quest", "64")][2]) == int(table[("full cache", "-")][2])  # evicts nothing
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "held-out windows" in capsys.readouterr().out
