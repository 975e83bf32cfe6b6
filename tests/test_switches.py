"""docs/kernels.md's table of switches names every environment choice the backends read, with
the values each accepts (so a user finds every opt-in kernel in one place)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cuattn.backends import ENV_VAR, geometry

TABLE = Path(__file__).resolve().parent.parent / "docs" / "kernels.md"
# each switch: the values geometry accepts for it
ACCEPTED = {
    geometry.KERNELS_ENV: geometry.KERNEL_FAMILIES,
    geometry.SM90_TILE_N_ENV: geometry.SM90_TILE_N_CHOICES,
    geometry.SM90_RESCALE_ENV: geometry.SM90_RESCALE_CHOICES,
    geometry.SM90_EXP2_ENV: geometry.SM90_EXP2_CHOICES,
    geometry.SM90_CONSUMERS_ENV: geometry.SM90_CONSUMERS_CHOICES,
    geometry.BWD_DQ_ENV: geometry.BWD_DQ_ORDERS,
    geometry.BWD_SM90_ENV: geometry.BWD_SM90_SCHEDULES,
    geometry.DECODE_ENV: geometry.DECODE_FAMILIES,
    geometry.DECODE_FP8_ENV: geometry.DECODE_FP8_FAMILIES,
    geometry.SCORE_BIAS_ENV: geometry.DECODE_FP8_FAMILIES,
    geometry.QUEST_ENV: geometry.QUEST_FAMILIES,
}


def _rows() -> dict[str, str]:
    """The switches table's rows: variable -> its values cell."""
    rows = {}
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`CUATTN_"):
            rows[cells[0].strip("`")] = cells[1]
    return rows


def test_every_environment_choice_is_in_the_table():
    names = {
        value
        for name, value in vars(geometry).items()
        if name.endswith("_ENV") and isinstance(value, str) and value.startswith("CUATTN_")
    }
    assert names == set(ACCEPTED), "a new switch: add it to ACCEPTED and docs/kernels.md"
    assert set(_rows()) == names | {ENV_VAR}


@pytest.mark.parametrize("variable", sorted(ACCEPTED))
def test_the_table_lists_what_each_accepts(variable):
    listed = re.findall(r"`([^`]+)`", _rows()[variable])
    assert listed == list(ACCEPTED[variable])
