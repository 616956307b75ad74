"""Independent implementations the reference is trained against in lockstep (oracles).

An arm that sets ``oracle = "hf"`` trains the reference as usual and, step by step, Hugging Face
``transformers.DeepseekV3ForCausalLM`` on the same weights and batches (:mod:`harness.oracles.hf`).
This module says, without importing the oracle, what it needs, so that a suite asking for it is
refused before anything is launched; which arms have a Hugging Face counterpart is the reference
subject's to say (``harness.subject.reference.arms.unsupported_by_hf``).
"""

from __future__ import annotations

import importlib.util

ORACLES = ("hf",)
INSTALL_HINT = "pip install 'harness[fidelity]'"


def missing_dependency() -> str | None:
    """Why the Hugging Face oracle cannot run here (transformers not importable), or None."""
    try:
        found = importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):  # a module blocked by a None entry in sys.modules
        found = False
    return None if found else f"needs transformers, which is not installed: {INSTALL_HINT}"
