"""torchrec's own PEC (PR #4498, torchrec 1.9.2) trained in lockstep with the reference's PEC table.

The reference's :mod:`~harness.reference.pec` is written after torchrec's ``PECAll2AllSeqWait``,
``PECGradientApply`` and ``TrainPipelinePEC``; here those classes themselves, and FBGEMM's fused
row-wise optimizer behind a ``SplitTableBatchedEmbeddingBagsCodegen`` (TBE, the FUSED kernel: the
only one that runs on CPU), train a second copy of every shard on the same ids and the same upstream
gradients. Each process hosts one logical rank (EP equals the process count), and torchrec's
all-to-alls run over the arm's own process group.

**Same ids, same gradients.** The reference's table looks a batch up and splits its distinct ids
into OL and NOL (:class:`~harness.reference.pec.Lookup`). A forward hook on that table builds
torchrec's forward of the same positions: per part, the positions ordered by the rows' owners (the
rank-major order torchrec's input dist produces), ``PECAll2AllSeqInfo`` with the permutes and
``OverlapSplits`` of those orders, and ``PECAll2AllSeqWait.apply`` on the looked-up rows. The hook
returns ``ref + (tr - tr.detach())``: the same values bit for bit, while autograd hands the
reference's upstream gradient to torchrec's backward in the model's own backward pass. The owners
receive the ids of each part (torchrec's input dist), as the ``KeyedJaggedTensor`` that
``PECGradientApply.apply`` looks up again in the TBE, whose backward steps the fused optimizer.

**The pipelined order** (``torchrec/distributed/train_pipeline/pec_train_pipeline.py``, 1.9.2,
``TrainPipelinePEC.progress`` from line 449): ``TrainPipelinePEC`` calls ``torch.cuda.Event()`` in its
``__init__`` (line 70), so on CPU torch it cannot be built; its steps run here at the same points of
the reference's step:

* before forward N (line 524): #6 ``_start_deferred_nol_grad`` (line 503), ``grad_dist`` of NOL N-1,
  i.e. ``PECGradientApply.dist()``;
* after forward N: #9 ``_wait_pec_grad`` of those (line 532), ``apply()`` of NOL N-1;
* backward N: #11 ``_backward`` (line 550): ``PECAll2AllSeqWait.backward`` builds the appliers;
* after backward N: #12 ``_start_pec_ol_grad`` (line 562), ``dist()`` of OL N;
* after the dense optimizer step N (#13, line 566): #14 ``apply()`` of OL N (line 571), then
  ``_defer_nol_grad`` hands NOL N to the next call, or on the last batch drains it in place
  (lines 572-576).

**Events.** For the time of the oracle, ``PECGradientApply.dist`` and ``apply`` are wrapped (the
one patch made to torchrec at run time): the first ``dist()`` of an applier and every ``apply()``
emit a start and an apply event into the reference's own PEC event stream, module
:data:`MODULE`, with ``in_autograd`` taken where they run. So ``pec-invariants`` judges torchrec's
code as it judges the reference's, and a ``dist()`` fired from torchrec's backward (the order
before #4498) fails ``pec:no-autograd-start``.

**Records.** After every batch each process compares its shard of torchrec's table with the
reference's, row by row, in float64: a row's error is its largest absolute difference over its
largest reference magnitude. Process rank 0 records one line per batch with the worst row of the
whole table (``pec-oracle`` judges it)::

    {"step": N, "oracle": "torchrec", "tables": {"model.embed_tokens": {"rows": V, "max_rel_err": e,
     "worst_row": r, "abs_diff": d}}}
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.distributed.pec_collision_handlers import OverlapSplits
from torchrec.distributed.pec_comm_ops import PECAll2AllSeqInfo, PECAll2AllSeqWait, PECGradientApply
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from harness.reference.model import DeepseekV3ForCausalLM
from harness.reference.pec import ADAGRAD_EPS, Lookup, PECConfig, PECTrainer, ShardedEmbedding
from harness.reference.pec import MODULE as REFERENCE_MODULE

MODULE = "torchrec:" + REFERENCE_MODULE  # the oracle's table in the PEC events and the records
OPTIMIZERS = {"rowwise-sgd": EmbOptimType.EXACT_SGD, "rowwise-adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}
PARTS = ("OL", "NOL")
FidelitySink = Callable[[dict], None]


@dataclass
class _Part:
    """One part of one batch on this rank: the ids it sends (global, distinct, for the events) and,
    on the owner, the received rows' local ids as torchrec's apply looks them up again."""

    batch: int
    part: str
    sent: torch.Tensor
    features: KeyedJaggedTensor
    received: torch.Tensor  # global ids of the rows this owner updates, distinct


class TorchrecTable:
    """torchrec's side of one logical rank's shard: a TBE with FBGEMM's fused row-wise optimizer,
    torchrec's autograd function and appliers, driven in TrainPipelinePEC's order."""

    def __init__(self, reference: ShardedEmbedding, config: PECConfig) -> None:
        self.reference = reference
        rows, self.dim = reference.weight.shape
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(rows, self.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            optimizer=OPTIMIZERS[config.pec_optimizer],
            learning_rate=config.lr,
            eps=ADAGRAD_EPS,
            pooling_mode=PoolingMode.NONE,
        )
        with torch.no_grad():
            self.weight.copy_(reference.weight)
        self.infos: dict[int, tuple[PECAll2AllSeqInfo, dict[str, _Part]]] = {}  # batch -> torchrec's ctx, parts
        self._started: set[int] = set()  # id() of the appliers whose dist() ran
        self._looked_up: Lookup | None = None
        reference.register_forward_pre_hook(self._keep_lookup)
        reference.register_forward_hook(self._forward)

    @property
    def weight(self) -> torch.Tensor:
        return self.tbe.split_embedding_weights()[0]

    def _keep_lookup(self, module: ShardedEmbedding, args: tuple) -> None:
        self._looked_up = module.looked_up

    def _forward(self, module: ShardedEmbedding, args: tuple, output: torch.Tensor) -> torch.Tensor:
        """torchrec's forward of the positions the reference just embedded (module docstring)."""
        lookup, self._looked_up = self._looked_up, None
        positions = lookup.inverse.flatten()
        owner = lookup.ids[positions] // module.rows_per_rank
        overlapped = lookup.overlapped[positions]
        orders = {}
        for part, mask in (("OL", overlapped), ("NOL", ~overlapped)):
            chosen = mask.nonzero().flatten()
            orders[part] = chosen[torch.argsort(owner[chosen], stable=True)]  # rank-major, positions in order
        sends = torch.stack([torch.bincount(owner[orders[p]], minlength=module.group.ep) for p in PARTS])
        gathered = [torch.empty_like(sends) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, sends)
        recvs = torch.stack([g[:, module.rank] for g in gathered], dim=1)  # [part, source]
        splits = OverlapSplits(
            input_splits=(sends[0].tolist(), sends[1].tolist()), output_splits=(recvs[0].tolist(), recvs[1].tolist())
        )
        merged = torch.cat([orders["OL"], orders["NOL"]])
        permute = torch.empty_like(merged)
        permute[merged] = torch.arange(merged.numel())
        info = PECAll2AllSeqInfo(
            forward_permute=permute,
            backward_ol_permute=orders["OL"],
            backward_nol_permute=orders["NOL"],
            backward_splits=splits,
            pg=dist.group.WORLD,
        )
        rows = output.detach().flatten(0, -2)
        parts = {
            p: self._part(lookup.batch, p, lookup.ids[positions[orders[p]]], splits, i) for i, p in enumerate(PARTS)
        }
        self.infos[lookup.batch] = (info, parts)
        anchor = torch.empty(0, requires_grad=True)
        theirs = PECAll2AllSeqWait.apply(info, rows[orders["OL"]], rows[orders["NOL"]], anchor).view_as(output)
        return output + (theirs - theirs.detach())  # the reference's values; torchrec's backward gets its gradient

    def _part(self, batch: int, part: str, ids: torch.Tensor, splits: OverlapSplits, index: int) -> _Part:
        """The owners' ids of one part, sent in torchrec's order (its input dist), as the KJT apply reads."""
        received = torch.empty(sum(splits.output_splits[index]), dtype=ids.dtype)
        dist.all_to_all_single(received, ids, splits.output_splits[index], splits.input_splits[index])
        local = received - self.reference.first_row
        features = KeyedJaggedTensor(keys=["tokens"], values=local, lengths=torch.ones_like(local, dtype=torch.int32))
        return _Part(batch, part, torch.unique(ids), features, torch.unique(received))

    def _lookup_fn(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.tbe(features.values(), features.offsets())

    def applier(self, batch: int, part: str) -> tuple[PECGradientApply, _Part]:
        info, parts = self.infos[batch]
        applier = info.ol_grad_apply if part == "OL" else info.nol_grad_apply
        if applier is None:
            raise RuntimeError(f"torchrec: no {part} applier of batch {batch}: its backward did not run")
        return applier, parts[part]

    def start(self, batch: int, part: str) -> None:
        """grad_dist: ``dist()`` of the part (idempotent)."""
        self.applier(batch, part)[0].dist()

    def apply(self, batch: int, part: str) -> None:
        """The awaitable's wait: ``apply()`` looks the owner's rows up again and steps the fused optimizer."""
        applier, found = self.applier(batch, part)
        applier.apply(found.features, self._lookup_fn, self.dim)
        if part == "NOL":
            del self.infos[batch]  # both parts applied

    def observe_start(self, applier: PECGradientApply) -> None:
        """Called by the wrapped ``dist()``: the first start of an applier of this table is an event."""
        found = self._find(applier)
        if found is not None and id(applier) not in self._started:
            self._started.add(id(applier))
            self.reference.events.emit("start", found.batch, found.part, found.sent, module=MODULE)

    def observe_apply(self, applier: PECGradientApply) -> None:
        found = self._find(applier)
        if found is not None:
            self._started.discard(id(applier))
            self.reference.events.emit("apply", found.batch, found.part, found.received, module=MODULE)

    def _find(self, applier: PECGradientApply) -> _Part | None:
        for info, parts in self.infos.values():
            if applier is info.ol_grad_apply:
                return parts["OL"]
            if applier is info.nol_grad_apply:
                return parts["NOL"]
        return None

    def worst_row(self) -> tuple[float, int, float]:
        """(relative error, global row, absolute difference) of this shard's worst row, in float64."""
        ours, theirs = self.reference.weight.detach().double(), self.weight.detach().double()
        diff = (ours - theirs).abs().amax(1)
        rel = diff / ours.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny)
        rel = torch.where(torch.isnan(rel), torch.inf, rel)  # a NaN row is the worst row
        row = int(rel.argmax())
        return rel[row].item(), self.reference.first_row + row, diff[row].item()


class _Observed:
    """``PECGradientApply.dist`` and ``apply`` wrapped while an oracle runs, reporting to its tables."""

    tables: list[TorchrecTable] = []
    _originals: dict[str, Any] = {}

    @classmethod
    def add(cls, table: TorchrecTable) -> None:
        if not cls._originals:
            cls._originals = {"dist": PECGradientApply.dist, "apply": PECGradientApply.apply}
            original_dist, original_apply = cls._originals["dist"], cls._originals["apply"]

            def dist_observed(applier: PECGradientApply) -> None:
                for t in cls.tables:
                    t.observe_start(applier)
                original_dist(applier)

            def apply_observed(applier: PECGradientApply, *args: Any) -> None:
                original_apply(applier, *args)
                for t in cls.tables:
                    t.observe_apply(applier)

            PECGradientApply.dist, PECGradientApply.apply = dist_observed, apply_observed
        cls.tables.append(table)

    @classmethod
    def remove(cls, table: TorchrecTable) -> None:
        cls.tables.remove(table)
        if not cls.tables and cls._originals:
            PECGradientApply.dist, PECGradientApply.apply = cls._originals["dist"], cls._originals["apply"]
            cls._originals = {}


# TrainPipelinePEC.progress's gradient steps at the reference's points (module docstring): (op, part, lag).
PIPELINE: dict[str, list[tuple[str, str, int]]] = {
    "before_forward": [("start", "NOL", 1)],  # #6
    "before_backward": [("apply", "NOL", 1)],  # #9
    "after_backward": [("start", "OL", 0)],  # #12
    "after_optimizer": [("apply", "OL", 0)],  # #14
}


class TorchrecLockstep(PECTrainer):
    """The reference's PEC trainer with torchrec's table beside each shard; ``step`` trains both and,
    on process rank 0, hands the batch's comparison to ``fidelity_sink``."""

    def __init__(self, config: PECConfig, *args: Any, fidelity_sink: FidelitySink | None = None, **kwargs: Any) -> None:
        self.torchrec: dict[int, TorchrecTable] = {}
        super().__init__(config, *args, **kwargs)
        self.fidelity_sink = fidelity_sink

    def _prepare_model(self, rank: int, model: DeepseekV3ForCausalLM) -> None:
        super()._prepare_model(rank, model)
        self.torchrec[rank] = TorchrecTable(self.tables[rank], self.config)
        _Observed.add(self.torchrec[rank])

    def _act(self, rank: int, step: int, point: str) -> None:
        super()._act(rank, step, point)
        table = self.torchrec[rank]
        for op, part, lag in PIPELINE.get(point, []):
            if step - lag >= 1:
                (table.start if op == "start" else table.apply)(step - lag, part)
        if point == "after_optimizer" and step == self.batches:  # _defer_nol_grad(ctx0, ctx0), then drain
            table.start(step, "NOL")
            table.apply(step, "NOL")

    def step(self, step: int) -> dict:
        record = super().step(step)
        (rank,) = self.torchrec  # one logical rank per process (refused otherwise at parse time)
        local = torch.tensor(self.torchrec[rank].worst_row(), dtype=torch.float64)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        rel, row, diff = max((g.tolist() for g in gathered), key=lambda g: g[0])
        if self.fidelity_sink is not None and dist.get_rank() == 0:
            table = {"rows": self.cfg.vocab_size, "max_rel_err": rel, "worst_row": int(row), "abs_diff": diff}
            self.fidelity_sink({"step": step, "oracle": "torchrec", "tables": {REFERENCE_MODULE: table}})
        return record

    def close(self) -> None:
        for table in self.torchrec.values():
            _Observed.remove(table)
        super().close()
