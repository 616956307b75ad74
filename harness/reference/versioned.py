"""Versioned backward with bounded gradient staleness (OpenPipe ART's versioned trainer graphs).

A :class:`VersionedModel` wraps one logical rank's model and optimizer:

* **Versions.** Live parameters carry a :class:`Version` ``(generation, revision)``. The revision
  goes up by one at each optimizer update, the generation when the weights are replaced
  (:meth:`VersionedModel.replace_weights`). A forward records its version; its backward is allowed
  only if the generation is unchanged and ``0 <= age <= max_gradient_staleness``, where ``age`` is
  the number of updates since the forward. Anything else is refused before anything is mutated.
* **Snapshots.** A forward runs on a detached copy of the live parameters taken at its version
  (one copy per version, shared by the forwards at that version), so later in-place optimizer
  updates neither break nor alter its graph. Gradients are taken with respect to the snapshot and
  published to the live parameters' ``.grad``.
* **Retention** of the forward's state until its backward: ``retain`` keeps the saved tensors;
  ``offload`` copies them to host memory through saved-tensor hooks, once per save (pinned on
  CUDA; on CPU a host-to-host copy that only exercises the pack/unpack path); ``replay`` keeps
  nothing and re-runs the forward at backward time on the record's snapshot with its saved RNG
  state, and checks that it reproduced the forward's loss bit for bit. All three give bitwise
  identical gradients.
* **Checkpoint** of the forwards still pending (:meth:`VersionedModel.state`, ``load_state``):
  each one's recipe and its version's snapshot; a graph cannot be saved, so a restored forward's
  backward replays it, under every retention.
* **Transactional commit.** The gradients of a batch of backwards are staged, validated, agreed on
  by every logical rank (errors are all-gathered across threads and processes), and only then
  published to ``.grad``; any failure leaves every ``.grad`` and weight untouched on every rank.
  (A rank that raises inside a backward cannot vote: its peers fail with it, through the group's
  abort in-process or the launcher's timeout across processes, and publish nothing either.)
  The optimizer step re-validates the origin version of every accumulated gradient, also by vote.
* **Importance correction** of stale gradients: ``w = clamp(exp(lp_now - lp_then), 0, clip)`` per
  selected token, detached and in fp32, multiplies only the cotangent of the selected-token
  logprobs, so the gradient is that of ``-mean(w * logprob_selected)`` while the reported loss stays
  the plain mean NLL.

Current logprobs (``lp_now``) of a batch *exist* when a forward of that same batch id already ran
at the current version: its own forward when the age is 0 (the weight is then exactly 1), or an
earlier ``always`` correction forward at this version. ``when_available`` uses them only then and
never adds a forward; ``always`` runs one no-grad forward under the live weights when they do not
exist. A batch id must name the same data every time it is used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from harness.reference.ep.exchange import region
from harness.reference.ep.group import LogicalGroup

RETENTIONS = ("retain", "offload", "replay")
CORRECTIONS = ("off", "when_available", "always")
# What a checkpoint keeps of a pending forward to replay it (VersionedModel.state), besides its snapshot.
RECIPE = ("batch", "version", "inputs", "labels", "loss", "logprobs", "rng")
# Longest error message one logical rank can contribute to a vote (bytes of UTF-8).
ERROR_BYTES = 1024

# All-gathers one message per logical rank ("" = no error) and returns them in logical-rank order.
Vote = Callable[[str], list[str]]


class Version(NamedTuple):
    generation: int
    revision: int


class VersionError(RuntimeError):
    """This rank's version protocol refuses a backward or an optimizer step."""


class CommitRefused(RuntimeError):
    """A logical rank refused; raised on every rank, after nothing was applied on any of them."""


def gradient_age(origin: Version, current: Version, max_gradient_staleness: int) -> int:
    """Updates since ``origin``; raises :class:`VersionError` if its gradient may not be applied now."""
    if origin.generation != current.generation:
        raise VersionError(
            f"parameters were replaced after forward (generation {origin.generation} -> {current.generation})"
        )
    age = current.revision - origin.revision
    if age < 0:
        raise VersionError(
            f"forward at revision {origin.revision} is newer than the parameters (revision {current.revision})"
        )
    if age > max_gradient_staleness:
        raise VersionError(f"gradient staleness {age} exceeds max_gradient_staleness {max_gradient_staleness}")
    return age


def solo_vote(message: str) -> list[str]:
    """The vote of a single logical rank in a single process."""
    return [message]


def group_vote(group: LogicalGroup, rank: int, device: torch.device) -> Vote:
    """A vote over every logical rank of ``group``, local threads and remote processes alike."""

    def vote(message: str) -> list[str]:
        data = message.encode()[:ERROR_BYTES]
        buffer = torch.zeros(ERROR_BYTES, dtype=torch.uint8)
        if data:
            buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = group.all_gather(rank, buffer.to(device))
        return [bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for t in gathered]

    return vote


def agree(vote: Vote, error: str, what: str) -> None:
    """Every rank learns every rank's error; all raise together, or none does."""
    failed = [f"logical rank {r}: {m}" for r, m in enumerate(vote(error)) if m]
    if failed:
        raise CommitRefused(f"{what} refused, nothing applied on any rank: " + "; ".join(failed))


def correction_weight(
    lp_now: torch.Tensor, lp_then: torch.Tensor, clip: float = 5.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token importance weight ``clamp(exp(lp_now - lp_then), 0, clip)`` (fp32, detached), and
    which tokens were clipped (``exp`` is never negative, so only the upper bound ever clips)."""
    raw = torch.exp(lp_now.detach().float() - lp_then.detach().float())
    return raw.clamp(0.0, clip), raw > clip


class Cotangent:
    """Per-token weights for the selected-token logprobs' cotangent, set when the backward runs."""

    weight: torch.Tensor | None = None


class _ScaleCotangent(torch.autograd.Function):
    """Identity on the [tokens, vocab] logprobs; scales row ``i`` of their cotangent by ``w[i]``.

    Under the mean-NLL loss the only nonzero entry of row ``i`` is the selected token's, so this
    scales exactly the cotangent of the selected-token logprobs.
    """

    @staticmethod
    def forward(ctx, logprobs: torch.Tensor, cotangent: Cotangent) -> torch.Tensor:
        ctx.cotangent = cotangent
        return logprobs.view_as(logprobs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        weight = ctx.cotangent.weight
        return (grad if weight is None else grad * weight.unsqueeze(-1)), None


def lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, cotangent: Cotangent | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean NLL of the labels, bitwise equal to ``causal_lm_loss``, and the selected-token
    logprobs (fp32, detached). Its gradient is scaled per token by ``cotangent.weight`` if set."""
    logprobs = torch.log_softmax(logits.flatten(0, 1).float(), dim=-1)
    targets = labels.flatten()
    selected = logprobs.detach().gather(1, targets.unsqueeze(1)).squeeze(1)
    return F.nll_loss(
        _ScaleCotangent.apply(logprobs, cotangent if cotangent is not None else Cotangent()), targets
    ), selected


class _RngState(NamedTuple):
    cpu: torch.Tensor
    cuda: torch.Tensor | None


def _rng_state(device: torch.device) -> _RngState:
    return _RngState(torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def _rng_restored(state: _RngState, device: torch.device) -> Iterator[None]:
    """Replay draws the forward's random numbers again (the RNG is process-wide: logical ranks in
    threads share it, which is sound because the reference model draws none)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state.cpu)
        if state.cuda is not None:
            torch.cuda.set_rng_state(state.cuda, device)
        yield


def _offload_hooks(device: torch.device) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved tensors go to host memory, in their own strides (so backward kernels see the same layout)."""
    pin = device.type == "cuda"

    def pack(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        strides = torch.empty_like(tensor, device="meta").stride()
        host = torch.empty_strided(tensor.size(), strides, dtype=tensor.dtype, pin_memory=pin)
        host.copy_(tensor, non_blocking=pin)
        return tensor.device, host

    def unpack(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        origin, host = packed
        return host.to(origin, non_blocking=pin)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


@dataclass(eq=False)
class _Graph:
    loss: torch.Tensor
    cotangent: Cotangent


@dataclass(eq=False)
class ForwardRecord:
    """One forward, kept until its backward: what ran, at which version, and its graph or its recipe."""

    seq: int  # creation order on this rank; backwards run in it
    batch: int
    version: Version
    inputs: torch.Tensor
    labels: torch.Tensor
    snapshot: dict[str, torch.Tensor]
    rng: _RngState
    loss: torch.Tensor  # detached fp32 scalar
    logprobs: torch.Tensor  # selected-token logprobs at forward time, fp32
    graph: _Graph | None  # None under replay, and once consumed by a backward
    restored: bool = False  # loaded from a checkpoint: no graph was ever built here, its backward replays


@dataclass
class Applied:
    """What one committed batch of backwards contributed, in creation order."""

    batches: list[int] = field(default_factory=list)
    ages: list[int] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    weight_sum: float = 0.0  # over the tokens of corrected backwards
    clipped: int = 0
    corrected_tokens: int = 0


class GradientTransaction:
    """Stages the gradients of several backwards; publishes them to ``.grad`` all-or-nothing."""

    def __init__(self, owner: VersionedModel, vote: Vote) -> None:
        self._owner = owner
        self._vote = vote
        self._staged: list[tuple[Version, int, dict[str, torch.Tensor]]] = []

    def stage(self, record: ForwardRecord, grads: dict[str, torch.Tensor]) -> None:
        self._staged.append((record.version, record.batch, grads))

    def commit(self) -> None:
        """Validate locally, agree with every rank, sum in staging order, then publish."""
        agree(self._vote, self._validate(), "commit")
        params = self._owner.params
        totals = {}
        for name, param in params.items():
            parts = [grads[name] for _, _, grads in self._staged if name in grads]
            if not parts:
                continue
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            if param.grad is not None:
                total = param.grad + total
            totals[name] = _obey_layout(total, param)
        # Nothing below can fail: every shape, dtype and device was validated.
        for name, grad in totals.items():
            params[name].grad = grad
        self._owner._grad_origins.extend(version for version, _, _ in self._staged)

    def _validate(self) -> str:
        owner = self._owner
        for version, batch, grads in self._staged:
            try:
                gradient_age(version, owner.version, owner.max_gradient_staleness)
            except VersionError as exc:
                return f"batch {batch}: {exc}"
            for name, grad in grads.items():
                param = owner.params.get(name)
                if param is None or (grad.shape, grad.dtype, grad.device) != (param.shape, param.dtype, param.device):
                    return f"batch {batch}: gradient {name} does not match its parameter"
        return ""


def _obey_layout(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Give the gradient the parameter's strides, as autograd's accumulation into ``.grad`` does."""
    if grad.stride() == param.stride():
        return grad
    return torch.empty_like(param).copy_(grad)


class VersionedModel:
    """One logical rank's model and optimizer under the version protocol."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        max_gradient_staleness: int = 2,
        retention: str = "retain",
        correction: str = "off",
        correction_clip: float = 5.0,
        grad_divisor: int = 1,
    ) -> None:
        if max_gradient_staleness < 0:
            raise ValueError(f"max_gradient_staleness must be >= 0, got {max_gradient_staleness}")
        if retention not in RETENTIONS:
            raise ValueError(f"retention must be one of {RETENTIONS}, got {retention!r}")
        if correction not in CORRECTIONS:
            raise ValueError(f"correction must be one of {CORRECTIONS}, got {correction!r}")
        self.model = model
        self.optimizer = optimizer
        self.max_gradient_staleness = max_gradient_staleness
        self.retention = retention
        self.correction = correction
        self.correction_clip = correction_clip
        # The loss is divided by this before backward (the data-parallel degree), as plain training does.
        self.grad_divisor = grad_divisor
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.version = Version(0, 0)
        self.forwards = 0  # model forwards for training and for correction
        self.recomputes = 0  # replayed forwards
        self._seq = 0
        self._snapshot: tuple[Version, dict[str, torch.Tensor]] | None = None
        self._current_logprobs: dict[int, torch.Tensor] = {}  # batch id -> logprobs at self.version
        self._grad_origins: list[Version] = []

    # -- forward -------------------------------------------------------------------------------

    def forward(self, batch: int, inputs: torch.Tensor, labels: torch.Tensor) -> ForwardRecord:
        """Run the forward of ``batch`` at the current version and keep what its backward needs."""
        snapshot = self._current_snapshot()
        rng = _rng_state(inputs.device)
        cotangent = Cotangent()
        with self._retention_context(inputs.device):
            loss, logprobs = self._loss(snapshot, inputs, labels, cotangent)
        self.forwards += 1
        if self.correction != "off":
            self._current_logprobs[batch] = logprobs
        record = ForwardRecord(
            seq=self._seq,
            batch=batch,
            version=self.version,
            inputs=inputs,
            labels=labels,
            snapshot=snapshot,
            rng=rng,
            loss=loss.detach(),
            logprobs=logprobs,
            graph=None if self.retention == "replay" else _Graph(loss, cotangent),
        )
        self._seq += 1
        return record

    def _loss(
        self, snapshot: dict[str, torch.Tensor], inputs: torch.Tensor, labels: torch.Tensor, cotangent: Cotangent
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.func.functional_call(self.model, snapshot, (inputs,))
        return lm_loss(logits, labels, cotangent)

    def _current_snapshot(self) -> dict[str, torch.Tensor]:
        if self._snapshot is None or self._snapshot[0] != self.version:
            with torch.no_grad():
                copies = {n: p.detach().clone().requires_grad_() for n, p in self.params.items()}
            self._snapshot = (self.version, copies)
        return self._snapshot[1]

    def _retention_context(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.retention == "offload":
            return _offload_hooks(device)
        if self.retention == "replay":
            return torch.no_grad()
        return contextlib.nullcontext()

    # -- backward ------------------------------------------------------------------------------

    def preflight(self, records: Sequence[ForwardRecord], vote: Vote) -> list[int]:
        """Ages of ``records``; refused on every rank if any rank may not run one of its backwards."""
        ages, error = [], ""
        for record in records:
            try:
                ages.append(gradient_age(record.version, self.version, self.max_gradient_staleness))
            except VersionError as exc:
                error = f"batch {record.batch}: {exc}"
                break
        agree(vote, error, "backward")
        return ages

    def backward(
        self, records: Sequence[ForwardRecord], vote: Vote, *, apply_twice_batch: int | None = None
    ) -> Applied:
        """Backward ``records`` in creation order and publish their summed gradients to ``.grad``.

        Every rank must call this with the same number of records, so collectives inside the
        backwards line up. ``apply_twice_batch`` is a planted bug for negative tests: that batch's
        gradient is staged twice.
        """
        ordered = sorted(records, key=lambda r: r.seq)
        applied = Applied()
        transaction = GradientTransaction(self, vote)
        for record, age in zip(ordered, self.preflight(ordered, vote)):
            weight = self._correction_weight(record, applied)
            grads = self._gradients(record, weight)
            for _ in range(2 if record.batch == apply_twice_batch else 1):
                transaction.stage(record, grads)
                applied.batches.append(record.batch)
                applied.ages.append(age)
                applied.losses.append(record.loss)
        transaction.commit()
        return applied

    def _correction_weight(self, record: ForwardRecord, applied: Applied) -> torch.Tensor | None:
        if self.correction == "off":
            return None
        lp_now = self._current_logprobs.get(record.batch)
        if lp_now is None and self.correction == "always":
            with torch.no_grad():
                _, lp_now = lm_loss(self.model(record.inputs), record.labels)
            self.forwards += 1
            self._current_logprobs[record.batch] = lp_now
        if lp_now is None:
            return None
        weight, clipped = correction_weight(lp_now, record.logprobs, self.correction_clip)
        applied.weight_sum += float(weight.double().sum())
        applied.clipped += int(clipped.sum())
        applied.corrected_tokens += weight.numel()
        return weight

    def _gradients(self, record: ForwardRecord, weight: torch.Tensor | None) -> dict[str, torch.Tensor]:
        graph = record.graph
        if graph is None:
            graph = self._replay(record)
        record.graph, record.restored = None, False  # a graph is consumed by its backward, a replayed one too
        graph.cotangent.weight = weight
        names = list(record.snapshot)
        grads = torch.autograd.grad(graph.loss / self.grad_divisor, [record.snapshot[n] for n in names])
        return dict(zip(names, grads))

    def _replay(self, record: ForwardRecord) -> _Graph:
        if self.retention != "replay" and not record.restored:
            raise VersionError(f"batch {record.batch}: its graph was already consumed by a backward")
        cotangent = Cotangent()
        device = record.inputs.device
        with _rng_restored(record.rng, device), torch.enable_grad(), region(phase="recompute"):
            loss, _ = self._loss(record.snapshot, record.inputs, record.labels, cotangent)
        self.recomputes += 1
        if not torch.equal(loss.detach().view(torch.int32), record.loss.view(torch.int32)):
            raise RuntimeError(
                f"replay of batch {record.batch} diverged: loss {float(loss)} != {float(record.loss)} at forward"
            )
        return _Graph(loss, cotangent)

    # -- updates -------------------------------------------------------------------------------

    def optimizer_step(self, vote: Vote = solo_vote) -> None:
        """Re-validate the origin of every accumulated gradient on every rank, then step and
        advance the revision; refused everywhere, before anything moves, if any rank objects."""
        error = ""
        if self._grad_origins:
            try:
                for origin in self._grad_origins:
                    gradient_age(origin, self.version, self.max_gradient_staleness)
            except VersionError as exc:
                error = f"optimizer step: {exc}"
        elif any(p.grad is not None for p in self.params.values()):
            error = "optimizer step: .grad holds gradients that no versioned backward published"
        agree(vote, error, "update")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._grad_origins.clear()
        self._advance(Version(self.version.generation, self.version.revision + 1))

    def replace_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load new weights (a new generation): every earlier forward and gradient becomes invalid."""
        self.model.load_state_dict(state_dict)
        self._advance(Version(self.version.generation + 1, 0))

    def _advance(self, version: Version) -> None:
        self.version = version
        self._current_logprobs.clear()  # they were the logprobs of the previous version

    # -- checkpoint ----------------------------------------------------------------------------

    def state(self, records: Sequence[ForwardRecord]) -> dict[str, torch.Tensor]:
        """This rank's protocol as tensors, with ``records`` still waiting for their backward: the
        version, the forward counters, the current logprobs (the correction's state), each record's
        recipe (batch, version, inputs, labels, loss, logprobs, RNG state) and each version's
        snapshot once, however many records share it. Between updates, so nothing is staged."""
        tensors = {
            "version": torch.tensor(self.version),
            "counters": torch.tensor([self._seq, self.forwards, self.recomputes]),
        }
        for batch, logprobs in self._current_logprobs.items():
            tensors[f"logprobs_now.{batch}"] = logprobs
        for record in records:
            recipe = {
                "batch": torch.tensor(record.batch),
                "version": torch.tensor(record.version),
                "inputs": record.inputs,
                "labels": record.labels,
                "loss": record.loss,
                "logprobs": record.logprobs,
                "rng": record.rng.cpu,
            }
            if record.rng.cuda is not None:
                recipe["rng_cuda"] = record.rng.cuda
            tensors |= {f"forward.{record.seq}.{key}": tensor for key, tensor in recipe.items()}
            generation, revision = record.version
            for name, tensor in record.snapshot.items():
                tensors[f"snapshot.{generation}.{revision}.{name}"] = tensor.detach()
        return tensors

    def load_state(self, tensors: dict[str, torch.Tensor], device: torch.device) -> list[ForwardRecord]:
        """Restores what :meth:`state` saved and returns the records, in creation order.

        An autograd graph cannot be saved: a restored record has none, under every retention. Its
        backward rebuilds it by replaying the forward on its restored snapshot with its saved RNG
        state, as ``replay`` always does, and the replay checks that it reproduced the saved loss
        bit for bit. ``tensors`` raises for a name it lacks (the checkpoint's own mapping names the key)."""
        self.version = Version(*tensors["version"].tolist())
        self._seq, self.forwards, self.recomputes = tensors["counters"].tolist()
        now = [key for key in tensors if key.startswith("logprobs_now.")]
        self._current_logprobs = {int(key.split(".")[1]): tensors[key].to(device) for key in now}
        snapshots: dict[Version, dict[str, torch.Tensor]] = {}
        records = []
        for seq in sorted({int(key.split(".")[1]) for key in tensors if key.startswith("forward.")}):
            recipe = {key: tensors[f"forward.{seq}.{key}"] for key in RECIPE}
            version = Version(*recipe["version"].tolist())
            if version not in snapshots:
                prefix = f"snapshot.{version.generation}.{version.revision}."
                snapshots[version] = {name: tensors[prefix + name].to(device).requires_grad_() for name in self.params}
            cuda = tensors.get(f"forward.{seq}.rng_cuda")
            records.append(
                ForwardRecord(
                    seq=seq,
                    batch=int(recipe["batch"]),
                    version=version,
                    inputs=recipe["inputs"].to(device),
                    labels=recipe["labels"].to(device),
                    snapshot=snapshots[version],
                    rng=_RngState(recipe["rng"], cuda),
                    loss=recipe["loss"].to(device),
                    logprobs=recipe["logprobs"].to(device),
                    graph=None,
                    restored=True,
                )
            )
        if records and records[-1].version == self.version:  # the next forward shares its snapshot, as it would have
            self._snapshot = (self.version, snapshots[self.version])
        return records
