"""The README and the docs pages: every relative link (and #anchor) resolves, every docs page is
reachable from the README's Topics table, and the README stays a few screens long."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "results" / "history.md",
         *sorted((ROOT / "bench" / "results").glob("study_*.md"))]
MAX_README_LINES = 250

LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[str]:
    """The lines that are not code: fenced blocks and indented (4-space) blocks are left out."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced and not line.startswith("    "):
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    for line in prose_lines(page.read_text()):
        m = HEADING.match(line)
        if m:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            if n:
                seen[f"{s}-{n}"] = 1
    return set(seen)


def relative_links(page: Path) -> list[str]:
    links = []
    for line in prose_lines(page.read_text()):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):  # code spans are not links
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked
                links.append(target)
    return links


def test_worked_example_of_the_slug():
    assert slug("KV capacity, as vLLM computes it") == "kv-capacity-as-vllm-computes-it"
    assert slug("vLLM V1, exactly: what `chunked` and the KV cache follow") == \
        "vllm-v1-exactly-what-chunked-and-the-kv-cache-follow"
    assert slug("How to add ...") == "how-to-add-"
    assert slug("report.html") == "reporthtml"


def test_link_finder_skips_code_and_absolute_links(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# T\n[a](x.md) and ![b](img/y.png#top) [c](https://e.org/z) `[d](w.md)` too\n"
                    "```\n[e](fenced.md)\n```\n    [f](indented.md)\n")
    assert relative_links(page) == ["x.md", "img/y.png#top"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert page.exists(), f"{page.relative_to(ROOT)}: missing"
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in relative_links(README) if t.partition("#")[0]}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md (add a row to its Topics table): {missing}"


def test_readme_fits_a_few_screens():
    num_lines = len(README.read_text().splitlines())
    assert num_lines <= MAX_README_LINES, (f"README.md has {num_lines} lines, over {MAX_README_LINES}: move the "
                                          "detail to a page under docs/ and link it from the Topics table")


DOCS_NAME = re.compile(r"(?<![\w./-])docs/([a-z0-9-]+\.md)")  # our pages: lower case and hyphens
NAMED_IN = ("sim", "policies", "backends", "traces", "reports", "bench", "scripts", "profiles", "tests", "docs")


def test_docs_pages_named_in_the_code_exist():
    """A `docs/NAME.md` that a docstring, message, profile or page names is a page of ours (pages
    are named in lower case with hyphens; another project's, such as llm-d's docs/disagg_pd.md, are not)."""
    missing = []
    for folder in NAMED_IN:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".md", ".json", ".toml") or not path.is_file():
                continue
            for name in DOCS_NAME.findall(path.read_text(errors="replace")):
                if not (ROOT / "docs" / name).exists():
                    missing.append(f"{path.relative_to(ROOT)}: docs/{name}")
    assert not missing, "pages named but not in docs/: " + "; ".join(sorted(set(missing)))


def test_the_ranges_table_of_options_md_names_every_ranged_flag():
    """Found by a new-user run: `--dp`'s range (1 to 64 ranks) was missing from options.md's table of
    physical ranges, which says it lists every number a user gives. Every flag of sim replay's
    options that declares a range is in the table's "used by" column."""
    from sim.app.options import ClusterOptions, ReplayOptions, flag_fields
    from sim.config import CacheConfig, SchedulerConfig

    text = (ROOT / "docs" / "options.md").read_text()
    table = text[text.index("### Physical ranges"):]
    table = table[:table.index("\n\n", table.index("| range |"))]
    missing = [opt.flag for cls in (SchedulerConfig, CacheConfig, ReplayOptions, ClusterOptions)
               for _, opt in flag_fields(cls) if opt.range is not None and f"`{opt.flag}`" not in table]
    assert missing == []
