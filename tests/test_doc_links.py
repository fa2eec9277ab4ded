"""Every relative link in README.md and docs/*.md reaches a file of the repository, and every `#anchor` a heading.

A link is read as GitHub reads it: relative to the folder of the page it is in (docs/policy.md's `api.md` is
docs/api.md, its `sandbox/policy.yaml` would be docs/sandbox/policy.yaml), an anchor as the slug GitHub gives a
heading. Links in code (fenced blocks and `spans`) are text, not links; links with a scheme (https:, mailto:) are
not the repository's.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
HTML = re.compile(r"<(?:a|img)\s[^>]*?(?:href|src)=\"([^\"]+)\"", re.I)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def prose(text: str) -> str:
    """The page without its code: fenced blocks and code spans hold example text, never links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(page: Path) -> list[str]:
    text = prose(page.read_text())
    return [*INLINE.findall(text), *REFERENCE.findall(text), *HTML.findall(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but - and _), spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading counts by its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, … as on GitHub."""
    found, seen = set(), {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        heading = re.match(r"^#{1,6}\s+(.+?)\s*#*\s*$", line)
        if heading:
            name = slug(heading.group(1))
            found.add(f"{name}-{seen[name]}" if name in seen else name)
            seen[name] = seen.get(name, 0) + 1
    return found


def broken(page: Path) -> list[str]:
    """The page's relative links that reach no file of the repository, or no heading of the page they name."""
    problems = []
    for target in links(page):
        if SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        if path.startswith("/"):
            destination = (ROOT / path.lstrip("/")).resolve()
        else:
            destination = (page.parent / path).resolve() if path else page
        if not destination.is_relative_to(ROOT) or not destination.exists():
            problems.append(f"{target}: no such file ({destination.relative_to(ROOT.parent)})")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            problems.append(f"{target}: {destination.relative_to(ROOT)} has no heading #{anchor}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_reaches_a_file_and_a_heading(page):
    assert broken(page) == [], f"{page.relative_to(ROOT)}: broken links"


def test_the_reader_finds_what_github_would_link():
    text = ("[a](x.md) ![b](img/y.png) `[c](z.md)` <a href=\"w.md\">w</a>\n[d]: ref.md\n"
            "```\n[e](fenced.md)\n```\n")
    found = [*INLINE.findall(prose(text)), *REFERENCE.findall(prose(text)), *HTML.findall(prose(text))]
    assert sorted(found) == ["img/y.png", "ref.md", "w.md", "x.md"]
    assert slug("Showing values: the `display` policy field") == "showing-values-the-display-policy-field"
    assert slug("What it costs") == "what-it-costs"


def test_the_adapters_page_installs_as_the_readme_does():
    """The extras come from this repository's folder (`pip install ".[langgraph]"`), not from an index."""
    readme = (ROOT / "README.md").read_text()
    adapters = (ROOT / "docs" / "adapters.md").read_text()
    assert re.search(r"""pip install ['"]\.\[openai-agents\]['"]""", readme)
    for extra in ("openai-agents", "langgraph"):
        assert re.search(rf"""pip install ['"]\.\[{extra}\]['"]""", adapters), extra
        assert f"unwind[{extra}]" not in adapters, extra
