"""Independent implementations the reference is trained against in lockstep (oracles).

An arm that sets ``oracle = "<name>"`` trains the reference as usual and, step by step, the oracle's
own model on the same weights and batches (:mod:`harness.oracles.lockstep`): Hugging Face
``transformers.DeepseekV3ForCausalLM`` (``"hf"``, :mod:`harness.oracles.hf`) or torchtitan's
DeepSeek-V3 (``"torchtitan"``, :mod:`harness.oracles.torchtitan`); a PEC arm trains its table beside
torchrec's own PEC (``"torchrec"``, :mod:`harness.oracles.torchrec`). This module says, without
importing an oracle, what it needs, so that a suite asking for it is refused before anything is
launched; which arms have a counterpart in an oracle is the reference subject's to say
(``harness.subject.reference.arms.unsupported_by``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Oracle:
    """An oracle: what its messages call it, the modules it imports, and the line that installs them."""

    label: str
    modules: tuple[str, ...]
    install: str


_PIP = "pip install -c constraints.txt"
ORACLES = {
    "hf": Oracle("Hugging Face", ("transformers",), f"{_PIP} 'harness[fidelity]'"),
    "torchtitan": Oracle("torchtitan", ("torchtitan", "triton"), f"{_PIP} 'harness[torchtitan]'"),
    # torchrec pulls the CUDA fbgemm-gpu, which does not load on CPU torch: the script swaps in the CPU build.
    "torchrec": Oracle("torchrec", ("torchrec", "fbgemm_gpu"), "tools/install-torchrec"),
}


def missing_dependency(name: str) -> str | None:
    """Why oracle ``name`` cannot run here (a module it needs is not importable), or None."""
    oracle = ORACLES[name]
    for module in oracle.modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a module blocked by a None entry in sys.modules
            found = False
        if not found:
            return f"needs {module}, which is not installed: {oracle.install}"
    return None
