"""The docs as a newcomer meets them: the README is a front door (title, one sentence, the two
commands, at most 150 lines), its links land, and a measured figure lives in docs/BENCHMARKS.md only:
no figure of it is repeated in the README, DESIGN, WORKFLOW, USAGE or the comments of a shipped YAML."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a measured figure: a decimal with 3+ places, a decimal with a unit, or an interval
FIGURE = re.compile(r"(?<![\w.])(?:\d+\.\d{3,}|\d+\.\d+ ?(?:min|ms|us|s|x|%|tok/s|tokens/s|GB/s|GFLOP/s)(?![\w/])"
                    r"|\[\d+\.\d+, \d+\.\d+\])")
PROSE = ("README.md", "docs/DESIGN.md", "docs/WORKFLOW.md", "docs/USAGE.md")
SHIPPED_YAML = ("src/ogspo/artifacts/default.yaml",)


def figures(text: str) -> set[str]:
    return {m.group(0) for m in FIGURE.finditer(text)}


def _comments(yaml_text: str) -> str:
    return "\n".join(line.split("#", 1)[1] for line in yaml_text.splitlines() if "#" in line)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lstrip("#").strip().lower()).replace(" ", "-")


def test_readme_opens_with_title_sentence_and_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines"
    fence = lines.index("```sh")
    sentence = " ".join(lines[2:fence]).strip()
    assert lines[0] == "# ogspo" and not lines[1] and sentence.endswith(".") and ". " not in sentence, sentence
    assert lines[fence + 1: fence + 4] == ["make run", "make test", "```"]
    assert fence <= 6


def test_no_benchmark_figure_is_repeated_elsewhere():
    bench = figures((ROOT / "docs" / "BENCHMARKS.md").read_text())
    repeated = {}
    for name in PROSE:
        if common := figures((ROOT / name).read_text()) & bench:
            repeated[name] = sorted(common)
    for name in SHIPPED_YAML:
        if common := figures(_comments((ROOT / name).read_text())) & bench:
            repeated[name] = sorted(common)
    assert not repeated, f"figures of docs/BENCHMARKS.md repeated: {repeated}"


def test_shipped_yaml_quotes_no_run_figures():
    for name in SHIPPED_YAML:
        assert not figures(_comments((ROOT / name).read_text())), name


def test_links_between_the_docs_land():
    for doc in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for target, anchor in re.findall(r"\]\(((?:docs/)?[A-Z]+\.md|config/README\.md)(?:#([\w\-]+))?\)", doc.read_text()):
            path = (doc.parent / target) if (doc.parent / target).is_file() else ROOT / target
            assert path.is_file(), f"{doc.name} links to {target}"
            if anchor:
                anchors = {_anchor(h) for h in re.findall(r"(?m)^#+ .*$", path.read_text())}
                assert anchor in anchors, f"{doc.name} links to {target}#{anchor}, which is no heading there"


def test_every_benchmark_section_sits_between_its_own_markers():
    """Each script rewrites only what lies between its `<!-- name:start -->` and `<!-- name:end -->`
    (benchmarks/benchdoc.py): the markers pair up in order, none nested, each pair holding one section
    heading, and every name belongs to a script that writes it."""
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    marks = re.findall(r"^<!-- (\w+):(start|end) -->$", text, flags=re.M)
    assert marks and len(marks) % 2 == 0, marks
    pairs = [(marks[i], marks[i + 1]) for i in range(0, len(marks), 2)]
    bad = [p for p in pairs if p[0][1] != "start" or p[1] != (p[0][0], "end")]
    assert not bad, f"markers out of order: {bad}"
    names = [p[0][0] for p in pairs]
    assert len(set(names)) == len(names), names
    writers = set(re.findall(r'write_section\(\s*"(\w+)"', "".join(
        p.read_text() for p in (ROOT / "benchmarks").glob("*.py"))))
    assert set(names) <= writers, sorted(set(names) - writers)
    for name in names:
        body = text.split(f"<!-- {name}:start -->", 1)[1].split(f"<!-- {name}:end -->", 1)[0]
        assert len(re.findall(r"^## ", body, flags=re.M)) == 1, name
