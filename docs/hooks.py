"""A mkdocs hook: every repository path the docs name must exist in the checkout.

mkdocs checks links between pages and their anchors (``validation`` in mkdocs.yml), but the docs
mostly name the code in code spans (`harness/run.py`, `suites/parity.toml`, `golden/`), which no
link check sees: a file renamed or removed leaves the page naming it silently wrong. So this hook
reads each page's markdown, and README.md (the front page, outside the site), and logs a warning
naming the page and the path for each one that does not exist; ``strict: true`` makes that fail
the build.

What counts as a path: a code span without spaces, or a word of a ```bash block, or a link target
that leaves the docs folder, whose first component is a top-level entry of the checkout
(``harness/...``, ``suites/...``, ``.github/...``, ``setup.py``). Placeholders are skipped: a
component with ``<``, ``*`` or ``{``, or one in capitals such as ``slurm/NAME.toml``; so are run
directory paths (``arms/<arm>/...``, ``logs/...``), whose first component is not in the checkout.
A trailing ``:line`` is dropped.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.repo_paths")

_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*(\w*)")
_CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_CAPS = re.compile(r"^[A-Z][A-Z0-9_]*(\.[a-z]+)?$")
# Top-level entries that exist only after a run or a build: never named as checkout files.
_GENERATED = {"site", "build", "dist"}


def top_level(root: Path) -> set[str]:
    """The first components a repository path may start with: what the checkout holds at its root."""
    return {p.name for p in root.iterdir() if p.name != ".git"} - _GENERATED


def _candidate(text: str, roots: set[str]) -> str | None:
    """The repository path ``text`` names, or None when it names none (or only a placeholder)."""
    text = text.strip().strip("'\"").rstrip(".,;")
    if not text or any(c in text for c in " <>*{}$=") or "..." in text or "://" in text:
        return None
    text = re.sub(r":\d+(-\d+)?$", "", text).split("#")[0]
    if text.startswith("./"):
        text = text[2:]
    parts = [p for p in text.split("/") if p]
    if not parts or parts[0] not in roots or any(_CAPS.match(p) for p in parts):
        return None
    if len(parts) == 1 and "/" not in text and "." not in text:
        return None  # a bare word such as `harness` or `tests` is the command or a concept, not a path
    return text


def named_paths(markdown: str, roots: set[str]) -> list[tuple[int, str]]:
    """(line number, path) for each repository path the markdown names, in order."""
    found: list[tuple[int, str]] = []
    fence: str | None = None
    shell = False
    for number, line in enumerate(markdown.splitlines(), 1):
        if m := _FENCE.match(line):
            if fence is None:
                fence, shell = m.group(2), m.group(3) in ("bash", "sh", "shell")
                continue
            if m.group(2).startswith(fence[0]) and len(m.group(2)) >= len(fence):
                fence = None
                continue
        if fence is not None:
            words = line.split("#")[0].split() if shell else []
        else:
            words = _CODE_SPAN.findall(line) + [t for t in _LINK.findall(line) if t.startswith("../")]
        for word in words:
            if word.startswith("../"):
                word = word[3:]
            if (path := _candidate(word, roots)) is not None:
                found.append((number, path))
    return found


def missing_paths(markdown: str, root: Path) -> list[tuple[int, str]]:
    """The named repository paths that do not exist under ``root``."""
    roots = top_level(root)
    return [(n, p) for n, p in named_paths(markdown, roots) if not (root / p).exists()]


def _root(config) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def _warn(page: str, missing: list[tuple[int, str]]) -> None:
    for number, path in missing:
        log.warning("%s:%d names `%s`, which does not exist in the checkout", page, number, path)


def on_pre_build(config) -> None:
    """README.md is not a page of the site, but it is the front page: hold it to the same rule."""
    root = _root(config)
    readme = root / "README.md"
    if readme.exists():
        _warn("README.md", missing_paths(readme.read_text(encoding="utf-8"), root))


def on_page_markdown(markdown: str, page, config, files) -> str:
    _warn(f"docs/{page.file.src_path}", missing_paths(markdown, _root(config)))
    return markdown
