"""The documentation: README.md and docs/*.md.

* docs/settings.md carries the settings table exactly as the code generates it;
* every relative link resolves to a file (and a heading, for a `#anchor` into a page);
* README.md stays a short first page;
* the pages speak to users, not in the first person.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ckpt_core.config import settings_table_markdown

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md")), ROOT / "benchmarks" / "README.md"]

BEGIN = "<!-- settings-table:begin -->"
END = "<!-- settings-table:end -->"


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str, inline_code: bool = False) -> str:
    """The text outside ``` fenced blocks (fenced lines become blank), without inline code unless asked."""
    out = []
    fence = None
    for line in text.splitlines():
        stripped = line.lstrip()
        if fence is None:
            m = re.match(r"(`{3,}|~{3,})", stripped)
            if m:
                fence = m.group(1)
                out.append("")
                continue
            out.append(line if inline_code else re.sub(r"(`+)(?:(?!\1).)+?\1", " ", line))
        else:
            if stripped.startswith(fence) and not stripped[len(fence):].strip():
                fence = None
            out.append("")
    return "\n".join(out)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"`|\*\*|__", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(path.read_text(encoding="utf-8"), inline_code=True).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


# ------------------------------------------------------------- settings table
def test_settings_table_matches_the_code():
    text = (DOCS / "settings.md").read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    begins = [i for i, line in enumerate(lines) if line.rstrip("\n") == BEGIN]
    ends = [i for i, line in enumerate(lines) if line.rstrip("\n") == END]
    assert len(begins) == 1 and len(ends) == 1 and begins[0] < ends[0], (
        f"docs/settings.md needs exactly one line {BEGIN!r} and, after it, one line {END!r}"
    )
    between = "".join(lines[begins[0] + 1:ends[0]])
    table = settings_table_markdown()
    expected = table if table.endswith("\n") else table + "\n"
    assert between == expected, (
        "the settings table in docs/settings.md is out of date: regenerate it with "
        f"`ckpt settings --markdown` and paste the output between the lines {BEGIN} and {END}"
    )
    assert "This table is generated: `ckpt settings --markdown`" in text


# --------------------------------------------------------------------- links
_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)


def _links(path: Path) -> list[str]:
    prose = _prose(path.read_text(encoding="utf-8"))
    return _INLINE_LINK.findall(prose) + _REF_LINK.findall(prose)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
            continue  # http(s)://, mailto:, ...
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest})")
            continue
        if anchor and dest.suffix == ".md" and dest.is_file() and anchor.lower() not in _anchors(dest):
            broken.append(f"{target} (no heading with anchor #{anchor} in {_rel(dest)})")
    assert not broken, f"{_rel(page)} has broken links: " + "; ".join(broken)


def test_pages_exist():
    names = {p.name for p in DOCS.glob("*.md")}
    for name in ("core.md", "lightning.md", "accelerate.md", "cli.md", "settings.md", "recovery.md",
                 "design.md", "benchmarks.md", "testing.md"):
        assert name in names, f"docs/{name} is missing"
        assert f"docs/{name}" in README.read_text(encoding="utf-8"), f"README.md does not link docs/{name}"


# ------------------------------------------------------------- README length
def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= 200, f"README.md has {n} lines (at most 200): move reference material to docs/"


# -------------------------------------------------------------- first person
_FIRST_PERSON = [
    re.compile(r"\bI\b"),                          # "I" (also in "I'd", "I'll"), case-sensitive
    re.compile(r"\bI[’'](?:m|ve)\b", re.I),        # "I'm", "I've"
    re.compile(r"\b(?:my|we|our)\b", re.I),        # "my", "we", "our" (also in "we're")
]


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_first_person(page):
    hits = []
    for lineno, line in enumerate(_prose(page.read_text(encoding="utf-8")).splitlines(), 1):
        found = {m.start(): m.group(0) for pattern in _FIRST_PERSON for m in pattern.finditer(line)}
        hits += [f"line {lineno}: {word!r} in {line.strip()!r}" for _, word in sorted(found.items())]
    assert not hits, (
        f"{_rel(page)} speaks in the first person (write what the code does, for its users): "
        + "; ".join(hits)
    )
