"""Every relative link in README.md and docs/*.md leads somewhere: the file exists, and a `#anchor`
names a heading of the markdown file it points into (GitHub's slugs). External links are not fetched.
"""

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target); the target ends at whitespace (a title may follow) or ")"
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'][^)]*[\"'])?\s*\)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text as rendered (code spans keep their content, links their
    text, emphasis marks dropped), lower-cased, every character but letters, digits, '-', '_' and
    spaces dropped, then each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = unicodedata.normalize("NFC", text).strip().lower()
    text = "".join(c for c in text if c in "-_ " or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings, with GitHub's -1, -2 suffixes for repeats."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link outside code blocks and code spans."""
    found = []
    for number, line in prose_lines(path.read_text()):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            found.append((number, match.group(1)))
    return found


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def broken_links(path: Path) -> list[str]:
    """What is wrong with each relative link of `path`, one line each."""
    problems = []
    for number, target in links(path):
        if not target or target.startswith(EXTERNAL):
            continue
        where = f"{shown(path)}:{number}: ({target})"
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not destination.exists():
            problems.append(f"{where}: {file_part} does not exist")
            continue
        if anchor:
            if destination.is_dir() or destination.suffix.lower() != ".md":
                problems.append(f"{where}: an anchor into {destination.name}, which is not markdown")
            elif unquote(anchor).lower() not in anchors(destination):
                problems.append(f"{where}: {destination.name} has no heading with anchor #{anchor}")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    assert not broken_links(path), "broken links:\n" + "\n".join(broken_links(path))


def test_docs_link_each_other():
    """The README leads to every guide, so none is orphaned."""
    readme_targets = {target.partition("#")[0] for _, target in links(ROOT / "README.md")}
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{doc.name}" in readme_targets, f"README.md does not link docs/{doc.name}"


def test_slugs_follow_github():
    assert slug("The three main jobs") == "the-three-main-jobs"
    assert slug("Flat GRPO, BranchGRPO and BranchGRPO + FP4") == "flat-grpo-branchgrpo-and-branchgrpo--fp4"
    assert slug("Diffusion: `diffusion_nft` and Sol-RL") == "diffusion-diffusion_nft-and-sol-rl"
    assert slug("Where each paper's mechanism lives") == "where-each-papers-mechanism-lives"
    assert slug("Harder carrying tasks: `assembly-v3.object`") == "harder-carrying-tasks-assembly-v3object"
    assert slug("See [the guide](docs/x.md) **now**") == "see-the-guide-now"


def test_checker_finds_broken_links(tmp_path: Path):
    (tmp_path / "other.md").write_text("# A heading\n\n## A heading\n")
    (tmp_path / "image.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[fine](other.md) [fine](other.md#a-heading) [fine](other.md#a-heading-1) [fine](#page)\n"
        "![fine](image.png) [skipped](https://example.com/missing.md) `[in code](missing.md)`\n"
        "[missing file](missing.md) [missing anchor](other.md#nothing) [here](#nowhere)\n"
        "[anchor into an image](image.png#x)\n"
        "```\n[in a code block](missing.md)\n# not a heading\n```\n"
    )
    problems = broken_links(page)
    assert len(problems) == 4, problems
    assert "missing.md does not exist" in problems[0]
    assert "#nothing" in problems[1] and "#nowhere" in problems[2] and "not markdown" in problems[3]
