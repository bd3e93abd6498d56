"""The documentation holds together: the README stays short, every link between pages lands on a
file, and docs/results/ keeps exactly the result files some page cites."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "docs" / "results"
README_MAX_LINES = 200


def test_the_readme_is_read_in_minutes():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; details belong in docs/"


def test_every_relative_link_lands_on_a_file():
    broken = []
    for page in [*PAGES, RESULTS / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == [], "\n".join(broken)


def test_every_result_file_is_cited_and_indexed():
    # Names may wrap across lines in the prose: compare without whitespace.
    prose = "".join(re.sub(r"\s+", "", page.read_text()) for page in PAGES)
    index = (RESULTS / "README.md").read_text()
    uncited, unindexed = [], []
    for path in sorted(RESULTS.iterdir()):
        if path.name == "README.md":
            continue
        cited_as = f"results/{path.name}" if path.is_dir() else path.name
        if cited_as not in prose:
            uncited.append(path.name)
        if f"`{path.name}{'/' if path.is_dir() else ''}`" not in index:
            unindexed.append(path.name)
    assert uncited == [], f"result files no page cites (delete them or cite them): {uncited}"
    assert unindexed == [], f"result files missing from docs/results/README.md: {unindexed}"


def test_every_cited_result_file_exists():
    missing = []
    for page in PAGES:
        for name in re.findall(r"(?:docs/)?results/([\w.\-/]+\.(?:json|txt|png|csv))", page.read_text()):
            if not (RESULTS / name).exists():
                missing.append(f"{page.relative_to(ROOT)}: results/{name}")
    assert missing == [], "\n".join(missing)
