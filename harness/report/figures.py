"""What every plot of the report shares: figures inlined as base64 PNG, labels shown as written.

matplotlib is imported here, when a report draws its first figure, not when the harness starts: a
command that draws nothing (list, doctor, submit --no-wait) never pays its ~0.3 s import. A run
starts it on a background thread as it launches its ranks (:func:`import_in_background`): the
harness process sits idle while they run, and its report no longer waits for the import.
"""

from __future__ import annotations

import base64
import importlib
import io
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

_DPI = 100


# Seconds to leave the launcher alone first: it spawns the ranks and meets them at the rendezvous
# (0.3-0.9 s here for 2-8 ranks), and an import running meanwhile would hold the GIL it needs.
_IMPORT_DELAY_S = 1.0


_background: list[threading.Timer] = []  # the import started by import_in_background, if any


def import_in_background() -> None:
    """Import matplotlib on a daemon thread, once the ranks are started (where it is not imported yet)."""
    if "matplotlib.figure" in sys.modules:
        return
    timer = threading.Timer(_IMPORT_DELAY_S, importlib.import_module, args=("matplotlib.figure",))
    timer.daemon = True
    _background.append(timer)
    timer.start()


def _after_background_import() -> None:
    """Waits out the background import, or cancels it if it has not begun. Two threads importing
    matplotlib's modules at once (they import each other) can each get the other's half-made module,
    and a process whose matplotlib was so made fails every figure it draws after."""
    while _background:
        timer = _background.pop()
        timer.cancel()
        timer.join()


def new_figure(width: float, height: float) -> Figure:
    """A figure of ``width`` x ``height`` inches laid out to fit its labels. A plain Figure, no pyplot:
    no global backend or figure state."""
    _after_background_import()
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=_DPI, layout="constrained")


def integer_ticks(ax: Axes) -> None:
    """Whole-number ticks on the x axis: steps and blocks have no halves."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def literal(text: str) -> str:
    """A label as matplotlib shows it literally: "$" would start mathtext."""
    return text.replace("$", r"\$")


def png_base64(fig: Figure) -> str:
    """The figure as a base64 PNG, for an <img src="data:..."> that keeps the report one offline file."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")
