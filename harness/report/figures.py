"""What every plot of the report shares: figures inlined as base64 PNG, labels shown as written."""

from __future__ import annotations

import base64
import io

from matplotlib.figure import Figure  # no pyplot: no global backend or figure state


def literal(text: str) -> str:
    """A label as matplotlib shows it literally: "$" would start mathtext."""
    return text.replace("$", r"\$")


def png_base64(fig: Figure) -> str:
    """The figure as a base64 PNG, for an <img src="data:..."> that keeps the report one offline file."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")
