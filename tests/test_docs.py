"""The docs: the site builds strictly, and what would make a page wrong fails the build.

Each build is a real ``mkdocs build --strict`` in a subprocess (about a second). The planted cases run on a copy of
the checkout (the docs and mkdocs.yml copied, every other top-level entry linked), so the hook sees the same
repository paths and only the planted page differs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FIRST_COMMANDS = [
    "pip install -c constraints.txt -e '.[test]' && harness run parity --ranks 2",
    "pip install -c constraints.txt -e '.[test]' && tools/install-torchrec && python -m pytest -n 2 -q",
]
_FENCE = re.compile(r"^\s*(```|~~~)")


def _build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _checkout_copy(tmp_path: Path) -> Path:
    """The docs and mkdocs.yml copied, everything else at the top level linked: a checkout whose pages may change."""
    root = tmp_path / "checkout"
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name in ("docs", "mkdocs.yml", ".git", "site"):
            continue
        (root / entry.name).symlink_to(entry)
    shutil.copytree(REPO / "docs", root / "docs")
    shutil.copy(REPO / "mkdocs.yml", root / "mkdocs.yml")
    return root


def _headings(markdown: str) -> set[str]:
    """The anchors mkdocs gives a page's headings (its default toc slugs)."""
    anchors, fenced = set(), False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)):
            anchors.add(slugify(re.sub(r"[`*]", "", m.group(1)), "-"))
    return anchors


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    built = _build(REPO, tmp_path / "site")
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "subjects" / "index.html").exists()


@pytest.mark.parametrize(
    "planted,named",
    [
        ("[the gate](throughput.md#no-such-section)", "#no-such-section"),
        ("[a page](no-such-page.md)", "no-such-page.md"),
    ],
    ids=["anchor", "page"],
)
def test_a_broken_internal_link_fails_the_build(tmp_path: Path, planted: str, named: str) -> None:
    root = _checkout_copy(tmp_path)
    page = root / "docs" / "ci.md"
    page.write_text(page.read_text() + f"\nSee {planted}.\n")
    built = _build(root, tmp_path / "site")
    assert built.returncode != 0
    assert "ci.md" in built.stderr and named in built.stderr


def test_a_repository_path_that_does_not_exist_fails_the_build_naming_page_and_path(tmp_path: Path) -> None:
    root = _checkout_copy(tmp_path)
    page = root / "docs" / "suites.md"
    page.write_text(page.read_text() + "\nThe suite lives in `suites/no-such-suite.toml`.\n")
    built = _build(root, tmp_path / "site")
    assert built.returncode != 0
    assert "docs/suites.md" in built.stderr and "`suites/no-such-suite.toml`" in built.stderr


def test_a_missing_path_in_the_readme_fails_the_build(tmp_path: Path) -> None:
    root = _checkout_copy(tmp_path)
    (root / "README.md").unlink()
    (root / "README.md").write_text(README.read_text() + "\nRead `harness/no_such_module.py`.\n")
    built = _build(root, tmp_path / "site")
    assert built.returncode != 0
    assert "README.md" in built.stderr and "`harness/no_such_module.py`" in built.stderr


def test_the_readme_is_a_front_page_that_starts_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 200
    assert lines[0] == "# harness"
    start = lines.index("```bash")
    end = lines.index("```", start + 1)
    assert lines[start + 1 : end][:2] == FIRST_COMMANDS


def test_every_readme_link_into_docs_names_a_page_and_anchor_that_exist() -> None:
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", README.read_text())
    assert links
    for target, anchor in links:
        page = REPO / target
        assert page.is_file(), target
        if anchor:
            assert anchor in _headings(page.read_text()), f"{target}#{anchor}"


def test_code_that_cites_a_docs_section_names_one_that_exists() -> None:
    """Docstrings cite `docs/<page>.md, "<Section>"`; a renamed section must not leave them pointing nowhere."""
    cited = 0
    for source in (REPO / "harness").rglob("*.py"):
        text = " ".join(source.read_text().split())
        for page, section in re.findall(r'(docs/[\w-]+\.md), "([^"]+)"', text):
            cited += 1
            assert slugify(section, "-") in _headings((REPO / page).read_text()), f"{source}: {page}, {section}"
    assert cited >= 3


def test_docs_lines_are_at_most_120_characters() -> None:
    for page in [README, *sorted((REPO / "docs").glob("*.md"))]:
        long = [n for n, line in enumerate(page.read_text().splitlines(), 1) if len(line) > 120]
        assert not long, f"{page.name}: lines {long}"


def test_the_readmes_own_subject_loads_and_parses_its_arms(tmp_path: Path) -> None:
    """The metrics-only subject on the front page is real code: its suite loads through it."""
    from harness.suites import load_suite

    text = README.read_text()
    [code] = re.findall(r"```python\n(.*?)```", text, re.S)
    [suite] = re.findall(r"```toml\n(.*?)```", text, re.S)
    (tmp_path / "my_trainer.py").write_text(code)
    (tmp_path / "my-suite.toml").write_text(suite)
    spec = load_suite(str(tmp_path / "my-suite.toml"))
    assert list(spec.arms) == ["a", "b"] and spec.arms["a"].families == ("metrics",)
