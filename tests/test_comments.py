"""Comments say why, not when: the history (dates, change numbers, pointers into bench/NOTES.md)
lives in git and NOTES, not in the library's or the kernels' comments."""

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HISTORY = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b[Cc]hanges? \d+|NOTES\.md|\bNOTES\b")
KERNEL_SUFFIXES = (".cu", ".cuh", ".h", ".hpp")


def comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment in a Python or C++ file (string literals are not comments)."""
    text = path.read_text()
    if path.suffix == ".py":
        tokens = tokenize.generate_tokens(io.StringIO(text).readline)
        return [(t.start[0], t.string) for t in tokens if t.type == tokenize.COMMENT]
    return [
        (i, line[line.index("//") :])
        for i, line in enumerate(text.splitlines(), 1)
        if "//" in line and not line.lstrip().startswith('"')
    ]


SOURCES = sorted((ROOT / "cuattn").rglob("*.py")) + sorted(
    p for p in (ROOT / "kernels").rglob("*") if p.suffix in KERNEL_SUFFIXES
)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_comments_carry_no_history(path):
    found = [f"{path.name}:{i}: {c}" for i, c in comments(path) if HISTORY.search(c)]
    assert not found, "\n".join(found)


def test_the_check_sees_a_dated_comment(tmp_path):
    py, cu = tmp_path / "a.py", tmp_path / "a.cu"
    py.write_text('x = "2026-11-26"  # measured 2026-11-26 (bench/NOTES.md, change 3)\n')
    cu.write_text("int x;  // see change 31\n")
    assert [HISTORY.search(c) is not None for _, c in comments(py) + comments(cu)] == [True, True]
