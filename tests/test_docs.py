"""The docs' relative links resolve: every file a Markdown page links to (or shows) exists, and
every #anchor names a heading of the page it points into (GitHub's heading ids)."""

from __future__ import annotations

import collections
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *(p for top in ("docs", "deploy", "manifests") for p in sorted((ROOT / top).rglob("*.md")))]


def prose(text: str, inline_code: bool = False):
    """(line number, line) outside fenced code blocks; inline code taken out unless `inline_code`
    (then only its backticks)."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line.replace("`", "") if inline_code else re.sub(r"`[^`]*`", "", line)


def heading_ids(text: str) -> set[str]:
    """GitHub's ids for a page's headings: lower case, punctuation dropped, spaces to hyphens,
    repeats numbered -1, -2, ..."""
    seen: collections.Counter[str] = collections.Counter()
    ids = set()
    for _, line in prose(text, inline_code=True):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        words = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))
        slug = re.sub(r"[^\w\- ]", "", words.lower()).replace(" ", "-")
        ids.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return ids


def broken_links(page: Path) -> list[str]:
    broken = []
    for number, line in prose(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}:{number}"
            if not dest.exists():
                broken.append(f"{where}: {target} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in heading_ids(dest.read_text()):
                broken.append(f"{where}: {target} names no heading of {dest.relative_to(ROOT)}")
    return broken


def test_heading_ids_are_githubs():
    text = "# Hydra heads\n## `speculation.pipeline` (GPU)\n```\n# not a heading\n```\n## Hydra heads\n"
    assert heading_ids(text) == {"hydra-heads", "speculationpipeline-gpu", "hydra-heads-1"}


def test_every_relative_link_in_the_docs_resolves():
    assert len(pages()) > 10
    broken = [line for page in pages() for line in broken_links(page)]
    assert not broken, "\n".join(broken)
