"""Check families: one module per family, each registering the [[checks]] kinds it owns.

* :mod:`~harness.checks.pairs`: two arms' metric curves at a tier (exact, ulp, close, band) and
  determinism (the same arm twice: metrics and events bit for bit);
* :mod:`~harness.checks.exchange`: token-exchange invariants on the launch/wait events, and the
  same event sequence in two arms;
* :mod:`~harness.checks.versioned`: the version protocol of a delayed pipeline on its updates;
* :mod:`~harness.checks.graph`: static checks of the graph a traced arm exported;
* :mod:`~harness.checks.collectives`: the collectives of a traced torchtitan step, and two arms alike;
* :mod:`~harness.checks.overlap`: that chunked exchanges really overlap, from a traced arm's graph
  or an eager arm's events;
* :mod:`~harness.checks.fidelity`: an oracle arm's lockstep records against Hugging Face;
* :mod:`~harness.checks.ranks`: every logical rank of an arm agrees on the step and its replicas;
* :mod:`~harness.checks.grad_sum`: a bf16-mixed arm's replicated gradients were summed in fp32;
* :mod:`~harness.checks.resume`: a run stopped and resumed by a fresh launch against one that never stopped;
* :mod:`~harness.checks.routing`: send counts of every exchange match the receive counts;
* :mod:`~harness.checks.weights`: two arms' final weights, bit for bit;
* :mod:`~harness.checks.pec`: a PEC embedding's gradient all-to-all: who starts it, when, how often,
  and that every lookup sees every earlier update;
* :mod:`~harness.checks.pec_oracle`: a PEC arm's table against torchrec's own PEC, row by row;
* :mod:`~harness.checks.change`: each arm at a change's head against itself at its base (``--base``);
* :mod:`~harness.checks.golden`: the metrics against the environment's golden (every run, unlisted);
* :mod:`~harness.checks.throughput`: a throughput run's ABBA gate (unlisted).
"""

from harness.checks import (  # noqa: F401  (they register)
    change,
    collectives,
    exchange,
    fidelity,
    golden,
    grad_sum,
    graph,
    overlap,
    pairs,
    pec,
    pec_oracle,
    ranks,
    resume,
    routing,
    throughput,
    versioned,
    weights,
)
from harness.checks.registry import FAMILIES, CheckFamily, register, run_check

CHECK_KINDS = tuple(kind for kind, family in FAMILIES.items() if family.listed)

__all__ = ["CHECK_KINDS", "FAMILIES", "CheckFamily", "register", "run_check"]
