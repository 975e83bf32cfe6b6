"""The README's commands are the ones CI runs, every python example in the README and in docs/
runs as written, and every relative link there points to a file and heading that exist."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"^TEST_COMMAND='(.+)'$", ci, re.M).group(1)
    assert f"\n{command}\n" in README


def python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, re.S)


PYTHON_BLOCKS = python_blocks(README)


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_every_readme_python_example_runs(index):
    exec(compile(PYTHON_BLOCKS[index], f"README.md python block {index}", "exec"), {})


DOC_BLOCKS = {page.name: python_blocks(page.read_text()) for page in DOCS}


@pytest.mark.parametrize(
    ("name", "index"),
    [(name, i) for name, blocks in DOC_BLOCKS.items() for i in range(len(blocks))],
)
def test_every_docs_python_example_runs(name, index):
    exec(compile(DOC_BLOCKS[name][index], f"docs/{name} python block {index}", "exec"), {})


def strip_fences(text):
    """The text without its fenced blocks, where a '#' starts no heading."""
    return re.sub(r"^(```+|~~~+).*?^\1", "", text, flags=re.S | re.M)


def anchors(text):
    """GitHub's heading ids: lower case, punctuation dropped, spaces to '-', repeats numbered."""
    seen, ids = {}, set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", strip_fences(text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        ids.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return ids


def relative_links(page):
    """Link targets outside code (fenced or inline) that name no scheme (http:, mailto:)."""
    text = re.sub(r"(`+).*?\1", "", strip_fences(page.read_text()), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z][a-z0-9+.-]*:", target):
            yield target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT)}")
        elif anchor and anchor not in anchors(file.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
