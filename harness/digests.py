"""Tensor digests: what ranks record of their parameters and gradients, and where two arms first part.

A digest stands in for a tensor that is too big to record every step: a bit-exact hash (blake2b
over its bytes) and two fp64 statistics, the max abs value and the L2 norm, so that a difference
can be sized without the tensor. Three kinds are recorded:

* ``ranks.rank<k>.jsonl``: every logical rank hashes its replicated (non-expert) parameters after
  the optimizer step, every :data:`HASH_EVERY` steps and at the last step, so that a replica that
  drifts shows at the next hashed step (the ``ranks-agree`` check);
* ``weights.rank<k>.json``: every logical rank hashes each of its parameters after its last
  update (the ``final-weights`` check);
* ``digests.jsonl``: logical rank 0 (hosted by process rank 0 in every layout) digests each of its
  parameters' gradients (after the sum over logical ranks, before clipping) and each parameter
  after the optimizer step, every step. Two arms of the same EP degree thus record the same
  parameter set, and when their metrics differ, :func:`first_divergence` names the first step and
  the first parameter, in backward order, whose gradient differs.

**Backward order** is the reverse of the parameters' registration order (``named_parameters``),
which for the reference follows the forward pass: embedding, then each block's attention and MLP,
then the final norm and ``lm_head``. Backward produces gradients from ``lm_head`` towards the
embedding, so a bug in one module's backward leaves the gradients of every module after it in
the forward unchanged, and the first gradient to differ in backward order belongs to that module.
(Within a block the two layer norms are registered after the MLP; they come first in this order.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from harness.records import DigestLine

# Replicated parameters are hashed every this many steps, and at the last step.
HASH_EVERY = 5
_HASH_BYTES = 16


def _flat(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """All tensors as one flat host tensor, in order: one copy instead of one op per tensor."""
    return torch.cat([t.detach().reshape(-1) for t in tensors]).cpu()


def parameters_hash(tensors: Iterable[torch.Tensor]) -> str:
    """One blake2b over the bytes of every tensor, in order: equal iff every bit is."""
    return hashlib.blake2b(_flat(tensors).view(torch.uint8).numpy(), digest_size=_HASH_BYTES).hexdigest()


def final_weights(parameters: Mapping[str, torch.Tensor], updates: int) -> dict:
    """``{"updates", "parameters": {name: hash}}``: one logical rank's weights after its last
    update (``weights.rank<k>.json``), which the ``final-weights`` check compares bit for bit."""
    return {"updates": updates, "parameters": {name: parameters_hash([p]) for name, p in parameters.items()}}


def digest_all(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    """``{name: [hash, max abs, L2 norm]}`` in the given (registration) order: the hash of each
    tensor's bytes, and fp64 statistics to size a difference. Computed on one flat copy, with
    segment reductions, so that a step's ~90 digests cost a few milliseconds, not one op each."""
    sizes = [t.numel() for t in tensors.values()]
    if not sizes:
        return {}
    flat = _flat(tensors.values())
    raw, itemsize = flat.view(torch.uint8).numpy(), flat.element_size()
    values = flat.double().numpy()
    starts = np.cumsum([0, *sizes[:-1]])
    nonempty = np.array(sizes) > 0
    max_abs, l2 = np.zeros(len(sizes)), np.zeros(len(sizes))
    if nonempty.any():  # reduceat misreads empty segments: reduce the others only
        max_abs[nonempty] = np.maximum.reduceat(np.abs(values), starts[nonempty])
        l2[nonempty] = np.sqrt(np.add.reduceat(values * values, starts[nonempty]))
    return {
        name: [
            hashlib.blake2b(raw[start * itemsize : (start + size) * itemsize], digest_size=_HASH_BYTES).hexdigest(),
            float(max_abs[i]),
            float(l2[i]),
        ]
        for i, (name, start, size) in enumerate(zip(tensors, starts, sizes))
    }


def _difference(a: list, b: list) -> tuple[float, float]:
    """Max abs and max relative difference of two digests' statistics, ``b`` the reference."""
    diffs = [abs(x - y) for x, y in zip(a[1:], b[1:])]
    rels = [d / abs(y) if d else 0.0 for d, y in zip(diffs, b[1:])]
    return max(diffs), max(rels)


def first_divergence(digests_a: list[DigestLine], digests_b: list[DigestLine], label_a: str, label_b: str) -> dict:
    """The first step whose digests differ and the first tensor there, in backward order.

    Gradients are looked at before parameters: a gradient that differs is where a step went
    wrong; a parameter that differs while every gradient agrees points at the optimizer. Returns
    ``{"summary", "step", "tensor" ("gradient" | "parameter"), "parameter", "max_abs_diff",
    "max_rel_diff"}``, or ``{"summary"}`` alone when nothing can be localised (no digests, no
    common parameter, or digests identical at every common step).
    """
    by_step_a = {d.step: d for d in digests_a}
    by_step_b = {d.step: d for d in digests_b}
    missing = [label for label, steps in ((label_a, by_step_a), (label_b, by_step_b)) if not steps]
    if missing:
        return {"summary": f"no gradient digests recorded in arm {' and '.join(repr(m) for m in missing)}"}
    for step in sorted(by_step_a.keys() & by_step_b.keys()):
        for key, what in (("grads", "gradient"), ("params", "parameter")):
            a, b = getattr(by_step_a[step], key), getattr(by_step_b[step], key)
            for name in reversed([n for n in a if n in b]):
                if a[name][0] != b[name][0]:
                    max_abs, max_rel = _difference(a[name], b[name])
                    prefix = f"step {step}: first {what} to differ"
                    if what == "parameter":
                        prefix = f"step {step}: gradients identical; first parameter to differ after the optimizer step"
                    return {
                        "summary": f"{prefix} is {name} (max abs {max_abs:.2g}, max rel {max_rel:.2g})",
                        "step": step,
                        "tensor": what,
                        "parameter": name,
                        "max_abs_diff": max_abs,
                        "max_rel_diff": max_rel,
                    }
    common = len(by_step_a.keys() & by_step_b.keys())
    return {"summary": f"gradient and parameter digests of logical rank 0 identical at all {common} common steps"}
