"""The map in the repo stays true: every relative link of the README, ``docs/`` and the bench pages reaches a file
(and, with ``#anchor``, one of its headings, as GitHub slugs them), and every repository path they name in backticks
(``dtorch/...``, ``tests/...``, ``bench/...``, ``scripts/...``, ``docs/...``) exists. A file moved or renamed
without its docs fails here, naming the page and the stale name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "bench" / "real_shapes.md",
         *sorted((ROOT / "docs").glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_named_paths_exist(page):
    text = page.read_text()
    stale = []
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path) if path else page
        if not target.exists():
            stale.append(f"link {link}: no such file")
        elif anchor and target.suffix == ".md":
            headings = {_slug(h) for h in re.findall(r"^#+ (.*)$", target.read_text(), re.M)}
            if anchor not in headings:
                stale.append(f"link {link}: no heading with that anchor in {target.relative_to(ROOT)}")
    for path in re.findall(r"`((?:dtorch|tests|bench|scripts|docs)/[\w./-]+)`", text):
        if not (ROOT / path).exists():
            stale.append(f"path {path}: not in the repository")
    assert not stale, f"{page.relative_to(ROOT)} names what is not there (fix the page or the name): {stale}"
