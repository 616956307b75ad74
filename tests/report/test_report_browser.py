"""report.html as a browser renders it: Debian's headless chromium, a screenshot and the rendered DOM.

Chromium is installed when missing (the ``chromium`` fixture of conftest.py: .ci/install-chromium, root
and apt-get), as the Slurm tests install Slurm. Where it cannot be had the test skips and says why,
except in CI (``CI`` set), where a report never checked in a browser is a failure.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import matplotlib.image
import numpy as np
from throughput_runs import write_throughput_run

from harness.report import read_throughput, write_html

INCONCLUSIVE_BANNER_RGB = (0x8A, 0x6D, 0x00)  # .banner.inconclusive in the report's CSS
# Chromium's own calls home are refused on a closed network, many at a time: keep it quiet.
QUIET = ("--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run")


def _chromium(chromium: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", *QUIET, f"--user-data-dir={tmp_path / 'p'}"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=180, check=True)


def test_a_throughput_report_renders_in_a_headless_browser(chromium: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    summary = write_throughput_run(run_dir, control=True, b_step_s=0.0835, verdict="inconclusive")
    summary["checks"].append(
        {"name": "eager: overlap", "kind": "overlap", "status": "pass", "detail": "4 of 4", "arms": ["eager"]}
    )
    write_html(run_dir / "report.html", summary, {}, throughput=read_throughput(run_dir))
    url = (run_dir / "report.html").as_uri()

    dom = _chromium(chromium, tmp_path, "--dump-dom", url).stdout
    assert '<section id="throughput">' in dom and "throughput INCONCLUSIVE" in dom
    assert dom.count('<details class="group"') == 2 and 'class="kind">overlap<' in dom
    assert dom.count("data:image/png;base64,") == 2  # the ratios with the control beside them; step times and memory

    screenshot = tmp_path / "report.png"
    _chromium(chromium, tmp_path, f"--screenshot={screenshot}", "--window-size=1280,4000", url)
    assert screenshot.is_file()
    pixels = (matplotlib.image.imread(screenshot)[..., :3] * 255).round().astype(int)
    assert pixels.shape[:2] == (4000, 1280)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 100, "the page rendered as one flat colour"
    banner = np.all(np.abs(pixels - INCONCLUSIVE_BANNER_RGB) <= 2, axis=-1)
    assert banner.sum() > 1280 * 20, "the inconclusive banners' colour is missing: the CSS did not apply"
