"""The README and ``docs/`` hold together: every relative link and ``#anchor`` resolves, the
README stays a front door (at most ``README_MAX_LINES`` lines) that links every docs page, and
``scripts/screenshot.py`` still draws the app.

Anchors follow GitHub's heading slugs: the heading's text lowercased, every character that is
not a letter, digit, ``_``, ``-`` or space dropped, each space turned into ``-``; a repeated
slug gets ``-1``, ``-2``, … in order. Links and headings inside fenced code blocks and inline
code do not count. External links (``https:``, ``mailto:``, …) are not fetched.

What it is not: a Markdown renderer (reference-style links are read from their definitions;
setext headings, HTML anchors and links to lines of a file are not looked for).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
# [text](target "title") and ![alt](target): text with one level of [brackets], a target with
# one level of balanced (parentheses), as CommonMark reads them.
INLINE_LINK = re.compile(r'!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]'
                         r'\(\s*<?((?:[^()\s<>]|\([^()\s<>]*\))*)>?(?:\s+"[^"]*")?\s*\)')
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


def prose(markdown: str) -> str:
    """The text outside fenced code blocks (each fenced line left empty, so lines still count)."""
    out, fenced = [], None
    for line in markdown.splitlines():
        m = FENCE.match(line)
        if m and (fenced is None or m.group(1) == fenced):
            fenced = m.group(1) if fenced is None else None
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor in ``markdown``, repeated slugs numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose(markdown).splitlines():
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(markdown: str) -> list[str]:
    """The targets of the inline links, images and reference definitions outside code."""
    text = CODE_SPAN.sub("", prose(markdown))
    return INLINE_LINK.findall(text) + REFERENCE_DEF.findall(text)


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file or ``#anchor`` does not exist, with the reason.

    Args:
        page: a Markdown file; its links are resolved from its folder.
    Returns:
        ``"page: target (why)"`` per broken link, in the order they appear; empty if none.
    """
    problems = []
    for target in links(page.read_text(encoding="utf-8")):
        if not target or EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(
                dest.read_text(encoding="utf-8")):
            problems.append(f"{page.name}: {target} (no heading #{anchor} in {dest.name})")
    return problems


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_github_slugs():
    assert slug("Tools (MCP)") == "tools-mcp"
    assert slug("What `scripts/setup.sh` installs") == "what-scriptssetupsh-installs"
    assert slug('Where "full prefill" and "time saved" come from') == (
        "where-full-prefill-and-time-saved-come-from")
    assert slug("Exit status and the `usage` record") == "exit-status-and-the-usage-record"
    assert slug("Split over 2 ranks on one machine") == "split-over-2-ranks-on-one-machine"
    assert slug("A — B") == "a--b"  # (each space becomes a hyphen, none collapsed)
    assert slug("캐시 on_disk") == "캐시-on_disk"  # (letters of any script, and _, are kept)
    assert anchors("# Notes\n## Notes\n```\n# not a heading\n```\n### Notes #\n") == {
        "notes", "notes-1", "notes-2"}


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(page):
    assert broken_links(page) == []


def test_the_links_are_read_at_all():
    # (a checker that finds no links passes everything: each page links somewhere)
    assert all(links(page.read_text(encoding="utf-8")) for page in pages())


def test_the_checker_flags_broken_links_and_anchors(tmp_path):
    # The negative control: the same function, on pages with known faults.
    (tmp_path / "other.md").write_text("# Other page\n\n## Part\n\n## Part\n")
    (tmp_path / "page.md").write_text(
        "# Page\n\n## Here (and now)\n\n"
        "[ok](#here-and-now) [ok](other.md) [ok](other.md#part-1) ![ok](other.md)\n"
        "[ok](https://example.com/missing.md) `[in code](missing.md)`\n"
        "```\n[in a fence](missing.md)\n```\n"
        "[no file](missing.md) [no anchor](#nowhere) [anchor in other](other.md#part-2)\n"
        "[spaces, not hyphens](#here-(and-now)) ![no image](pic.svg)\n"
        "[ref]: gone.md\n")
    assert broken_links(tmp_path / "page.md") == [
        "page.md: missing.md (no such file)",
        "page.md: #nowhere (no heading #nowhere in page.md)",
        "page.md: other.md#part-2 (no heading #part-2 in other.md)",
        "page.md: #here-(and-now) (no heading #here-(and-now) in page.md)",
        "page.md: pic.svg (no such file)",
        "page.md: gone.md (no such file)",
    ]


def test_the_readme_is_a_front_door_linking_every_docs_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(readme)}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert missing == []
    assert (ROOT / "docs" / "app.svg").resolve() in linked  # the screenshot is shown


def test_the_readme_keeps_the_test_command_ci_runs():
    # .ci/run runs exactly the README's test command: the two must not drift apart.
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == "scripts/setup.sh test && .venv/bin/python -m pytest -q"
    assert f"```sh\n{ci}\n```" in (ROOT / "README.md").read_text(encoding="utf-8")


def _screenshot_script():
    spec = importlib.util.spec_from_file_location("screenshot", ROOT / "scripts" / "screenshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_screenshot_script_draws_the_app(engine, home, tmp_path):
    shot = _screenshot_script()
    out = tmp_path / "shots" / "app.svg"
    svg = await shot.shoot(shot.scripted_engine(engine, delay=0.0), out)
    assert out.read_text(encoding="utf-8") == svg and svg.startswith("<svg")
    shown = re.sub(r"<[^>]+>", "", svg).replace("&#160;", " ")
    for message, _ in shot.TURNS:
        assert message in shown  # what was typed, in the conversation
    assert "Two days in Paris" in shown  # the scripted Markdown reply, rendered
    assert "## Two days" not in shown
    assert shot.CONVERSATION in shown and "% hit" in shown  # the sidebar and the status bar
    assert "terminal-localchat" in svg and not re.search(r"terminal-\d", svg)
