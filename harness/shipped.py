"""Where the folders that ship with the harness are: ``suites/``, ``golden/`` and ``slurm/``.

In the source tree they are top-level folders beside ``harness/``, where they are edited and
reviewed. A wheel carries each one inside the package as ``harness/_<folder>/`` (``setup.py`` maps
the folders to data packages), so an installed harness finds them with no source tree at all.
Adding a folder is one entry in ``setup.py``'s ``SHIPPED_FOLDERS``; code asks ``shipped_dir(name)``.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# The checkout holding this package, when it runs from one (directly or as an editable install).
SOURCE_ROOT = PACKAGE_DIR.parent


def shipped_dir(folder: str) -> Path:
    """The shipped folder ``folder``: the installed package's copy, else the source tree's."""
    packaged = importlib.resources.files("harness") / f"_{folder}"
    if packaged.is_dir():
        return Path(str(packaged))
    return SOURCE_ROOT / folder


def in_checkout() -> bool:
    """True when the harness runs from a git checkout of its source (so it has a commit to name)."""
    return (SOURCE_ROOT / ".git").exists()


def inside_package(path: Path) -> bool:
    """True for a path in the installed package: shipped data to read, never a place to write."""
    return path.resolve().is_relative_to(PACKAGE_DIR)
