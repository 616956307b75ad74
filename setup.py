"""Packaging layout; the project's metadata is in pyproject.toml.

Top-level folders of the source tree that the harness reads at run time ship inside the package as
data: ``suites/`` becomes ``harness/_suites/`` in the wheel, and so on (``harness/shipped.py`` finds
them either way). A folder is one entry here: its name and the files of it to ship.
"""

from setuptools import find_packages, setup

SHIPPED_FOLDERS = {
    "suites": ["*.toml"],
    "golden": ["**/*.json"],  # golden/<suite>/<env key>.json
    "slurm": ["*.toml", "*.sh"],  # cluster profiles, and the one-node test cluster's script
}
DATA_PACKAGES = {f"harness._{folder}": folder for folder in SHIPPED_FOLDERS}

setup(
    packages=find_packages(include=["harness*"]) + list(DATA_PACKAGES),
    package_dir=DATA_PACKAGES,
    package_data={
        "harness": ["report/templates/*.html"],
        **{package: SHIPPED_FOLDERS[folder] for package, folder in DATA_PACKAGES.items()},
    },
)
