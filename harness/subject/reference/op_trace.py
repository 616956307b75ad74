"""The reference's arms as :data:`~harness.op_divergence.ArmRun` values: one in-process training run
per pass, recorded op by op.

A :class:`Trainer` with one logical rank runs its steps on the calling thread, where the recorder's
dispatch mode sees them. With several logical ranks, one process runs them on pool threads, which
a thread-local mode does not see. In-process recording therefore takes ``ep = 1``, and a run with
EP > 1 must record each logical rank in a process of its own (a gloo run, one rank per process).
A traced arm's graph step is run node by node (:meth:`OpRecorder.interpret`). That calls the same
ops in the same order as the graph's generated code, and each op gets its node's module and
direction.
"""

from __future__ import annotations

from harness.op_divergence import ArmRun, OpRecorder
from harness.reference.chunking.trace_cache import GraphCache
from harness.reference.ep.ops import LAUNCH_OPS, NAMESPACE
from harness.reference.train import TrainConfig, Trainer

# An exchange launch returns a placeholder for the rows its wait will land: it holds no data yet.
PLACEHOLDER_OPS = frozenset(f"{NAMESPACE}.{name}.default" for name in LAUNCH_OPS)


def trainer_run(config: TrainConfig, steps: int, *, trace_cache: GraphCache | None = None) -> ArmRun:
    """Each pass builds a fresh :class:`Trainer` for ``config`` and records its steps 0 .. steps - 1."""

    def run(recorder: OpRecorder) -> None:
        trainer = Trainer(config, trace_cache=trace_cache)
        try:
            if len(trainer.logical_ranks) != 1:
                raise ValueError(
                    f"recording ops in-process: expected one logical rank per process (ep = 1 here),"
                    f" got {len(trainer.logical_ranks)}; their pool threads are invisible to the recorder"
                )
            graph = trainer.graph_step
            if graph is not None:
                if graph.boxed:
                    raise ValueError("recording ops of a graph step: expected FX ops, got regional Inductor kernels")
                graph.gm = recorder.interpret(graph.gm)
            with recorder:
                for step in range(steps):
                    recorder.step = step
                    trainer.step(step)
        finally:
            trainer.close()

    return run
