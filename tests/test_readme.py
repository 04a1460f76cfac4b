"""The README is the front door: short, every link and picture in it resolves, nothing in it that goes stale by
itself (issue numbers, commit hashes). The rest lives in the docs site (docs/, mkdocs.yml)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
MAX_LINES = 250


def local_links(text: str) -> list[str]:
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in target]


def test_the_readme_fits_on_a_few_screens():
    assert len(README.splitlines()) <= MAX_LINES


def test_every_local_link_and_picture_resolves():
    links = local_links(README)
    assert any(link.endswith(".svg") for link in links) and len(links) > 10
    missing = [link for link in links if not (ROOT / link.split("#", 1)[0]).exists()]
    assert not missing, missing


def test_a_broken_link_is_caught():
    assert local_links("see [x](docs/nope.md) and [y](https://example.com)") == ["docs/nope.md"]


def test_no_issue_numbers_or_commit_hashes():
    assert not re.search(r"\bissue \d+|\(issue|\bcommit [0-9a-f]{7}", README, re.I)
