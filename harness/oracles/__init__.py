"""Independent implementations the reference is trained against in lockstep (oracles).

An arm that sets ``oracle = "hf"`` trains the reference as usual and, step by step, Hugging Face
``transformers.DeepseekV3ForCausalLM`` on the same weights and batches (:mod:`harness.oracles.hf`).
This module says, without importing the oracle, what it needs, so that a suite asking for it is
refused before anything is launched.
"""

from __future__ import annotations

import importlib.util

from harness.reference.train import TrainConfig

ORACLES = ("hf",)
INSTALL_HINT = "pip install 'harness[fidelity]'"


def missing_dependency() -> str | None:
    """Why the Hugging Face oracle cannot run here (transformers not importable), or None."""
    try:
        found = importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):  # a module blocked by a None entry in sys.modules
        found = False
    return None if found else f"needs transformers, which is not installed: {INSTALL_HINT}"


def unsupported(config: TrainConfig) -> str | None:
    """Why an arm's configuration has no Hugging Face counterpart, or None.

    transformers routes by sigmoid scores and group-limited top-k, and trains one dense model:
    no delayed pipeline, no row-wise sharded embedding.
    """
    if type(config) is not TrainConfig:
        return "needs a plain arm: Hugging Face has no delayed pipeline or PEC embedding (unset their fields)"
    if config.routing != "learned":
        return f'needs routing = "learned": Hugging Face has no {config.routing} routing'
    scoring = config.model_config().scoring_func
    if scoring != "sigmoid":
        return f"needs a model with sigmoid scoring: Hugging Face has no {scoring}"
    return None
