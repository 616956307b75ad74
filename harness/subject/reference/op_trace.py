"""The reference's trainers recorded op by op: readied for an :class:`OpRecorder` in a rank
(:func:`prepare_recording`, the subject's ``record_ops`` hook), or run in-process as
:data:`~harness.op_divergence.ArmRun` values (:func:`trainer_run`).

A :class:`Trainer` with one logical rank runs its steps on the calling thread, where the recorder's
dispatch mode sees them. With several logical ranks, one process runs them on pool threads, which
a thread-local mode does not see. Recording therefore takes one logical rank per process: ``ep = 1``
in-process, or a gloo run with one rank per process (``harness run --first-op``).
A traced arm's graph step is run node by node (:meth:`OpRecorder.interpret`). That calls the same
ops in the same order as the graph's generated code, and each op gets its node's module and
direction.
"""

from __future__ import annotations

from harness.op_divergence import ArmRun, OpRecorder
from harness.reference.chunking.trace_cache import GraphCache
from harness.reference.ep.ops import LAUNCH_OPS, NAMESPACE
from harness.reference.train import TrainConfig, Trainer
from harness.subject.protocol import OpsNotRecordable

# An exchange launch returns a placeholder for the rows its wait will land: it holds no data yet.
PLACEHOLDER_OPS = frozenset(f"{NAMESPACE}.{name}.default" for name in LAUNCH_OPS)


def prepare_recording(trainer: Trainer, recorder: OpRecorder) -> None:
    """Readies a built trainer's steps for ``recorder`` on this thread; OpsNotRecordable where they
    would run elsewhere (pool threads) or as compiled kernels."""
    if len(trainer.logical_ranks) != 1:
        raise OpsNotRecordable(
            f"recording ops: expected one logical rank per process, got {len(trainer.logical_ranks)};"
            " their pool threads are invisible to the recorder"
        )
    graph = trainer.graph_step
    if graph is not None:
        if graph.boxed:
            raise OpsNotRecordable(
                "recording ops of a graph step: expected FX ops, got regional Inductor kernels (compile_attention)"
            )
        graph.gm = recorder.interpret(graph.gm)
    recorder.placeholders |= PLACEHOLDER_OPS


def trainer_run(config: TrainConfig, steps: int, *, trace_cache: GraphCache | None = None) -> ArmRun:
    """Each pass builds a fresh :class:`Trainer` for ``config`` and records its steps 0 .. steps - 1."""

    def run(recorder: OpRecorder) -> None:
        trainer = Trainer(config, trace_cache=trace_cache)
        try:
            prepare_recording(trainer, recorder)
            with recorder:
                for step in range(steps):
                    recorder.step = step
                    trainer.step(step)
        finally:
            trainer.close()

    return run
