"""Recording every aten op a run executes on this thread, with a content hash of each output.

Torch's :class:`~torch.utils._debug_mode.DebugMode` does the interception. It sees each op at the
dispatcher, forward and backward, and its ``record_nn_module`` tracks the nn.Module being run.
``log_tensor_hashes`` hashes every tensor output, skipping ops whose outputs are uninitialised
memory (``empty``). Three things are added here:

* **A position-sensitive hash.** DebugMode's ``"hash_tensor"`` XORs the elements together, so a
  permuted output hashes equal, and so do two equal elements that cancel. The reordered rows of a
  broken unpermute would then hash the same as the right ones. The hash passed to it instead is
  blake2b over the output's bytes: outputs hash equal exactly when they are bit-identical.
* **Where each op ran.** A forward op belongs to the innermost module on DebugMode's stack. That
  stack stops at the end of the forward, so a backward op is given the module of the forward op
  that made its grad_fn. FX records the same link when it traces (``seq_nr``). Autograd's own
  nodes, such as AccumulateGrad, have no forward op and get no module. The engine sums gradients
  while it runs the producing node, so such a sum is given that node's module. Ops of an FX graph
  run by :meth:`OpRecorder.interpret` take the module and direction of their node, from the
  ``nn_module_stack`` and ``autograd_backward`` metadata the trace wrote.
* **Data flow.** Each op lists the ops that produced its tensor inputs (the last op that returned
  or mutated each input), and whether an output of it is still alive when recording ends (a
  parameter, an optimizer state: what the run leaves behind). A comparison uses them to tell a
  difference that reaches the arm's state from one that heals or ends in a check.
* **Collectives in flight.** A torch.distributed collective (an op of the ``c10d`` namespace, such
  as ``c10d.allgather_``) returns before its work has landed the data in its outputs, so they are
  recorded without hashes, like placeholders: the op that next reads them hashes what landed.
* **Bounded memory.** Each op keeps a few short strings and numbers: its output shapes, hashes and
  absolute maxima, and no tensors; the data flow is kept through weak references. Only a capture
  pass (``capture=index``) clones tensors, and only those of the one op it was asked for.

Only the recording thread is seen: dispatch modes are thread-local. A process that runs its
logical ranks on pool threads must record each rank in a process of its own.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._debug_mode import DebugMode
from torch.utils._dtype_abbrs import dtype_abbrs
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

# torch.distributed's collectives: their outputs are still being written when the op returns.
IN_FLIGHT_NAMESPACE = "c10d"


@dataclass(frozen=True)
class OpRecord:
    """One aten op as it ran: where, what it returned, and a fingerprint of each output."""

    index: int  # execution order among the recorded ops, from 0
    step: int | None  # the training step the driver announced
    op: str  # the op overload, "aten.add.Tensor"
    module: str  # the innermost module's fqn ("model.layers.1.mlp.gate"), "" outside the model
    backward: bool
    outputs: tuple[str, ...]  # dtype and shape per tensor output, "f32[4, 32]"
    hashes: tuple[str | None, ...]  # per tensor output; None where the content means nothing
    absmax: tuple[float | None, ...]  # per tensor output; None for booleans, empty and opaque outputs
    inputs: tuple[int, ...]  # the ops whose outputs it read (the last writer of each tensor input)
    persists: bool  # an output of it was still alive, and last written by it, when recording ended

    def describe(self) -> dict[str, Any]:
        """The record as plain JSON data."""
        return {**asdict(self), "absmax": [json_float(m) for m in self.absmax]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OpRecord:
        """A record as :meth:`describe` wrote it (a rank's op file), typed again."""
        absmax = tuple(None if m is None else float(m) for m in data["absmax"])  # "inf" and "nan" as named
        tuples = {key: tuple(data[key]) for key in ("outputs", "hashes", "inputs")}
        return cls(**{**data, **tuples, "absmax": absmax})


def content_digest(tensor: torch.Tensor) -> str:
    """64 bits of blake2b over the tensor's bytes in row-major order: equal iff bit-identical
    (up to a hash collision), whatever the strides; a conjugate or negative view by its values. Hashed
    from a copy: numpy on the tensor's own storage would make it non-resizable for good, and FSDP frees
    an unsharded parameter by resizing its storage to 0."""
    flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1).cpu().clone()
    return hashlib.blake2b(flat.view(torch.uint8).numpy(), digest_size=8).hexdigest()


def _absmax(tensor: torch.Tensor) -> float | None:
    if tensor.dtype == torch.bool or tensor.numel() == 0:
        return None
    return float(tensor.detach().abs().max())


def json_float(value: float | None) -> float | str | None:
    """A float JSON can hold; non-finite values as their names ("inf", "nan")."""
    return value if value is None or abs(value) < float("inf") else str(value)


def _innermost(node: fx.Node) -> str:
    """The node's innermost module: from its module stack, or where a tracer kept none (torchtitan's
    make_fx tracer), from the ``module_fqn`` its modules annotate their nodes with."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        return next(reversed(stack.values()))[0]
    custom = node.meta.get("custom")
    return str(custom.get("module_fqn", "")) if isinstance(custom, dict) else ""


class _NodeInterpreter(fx.Interpreter):
    """Runs a graph node by node, telling the recorder which node each op belongs to.

    DebugMode's own ``DebugInterpreter`` serves ``torch.compile`` regions (``aot_eager``) and
    tracks modules only. A plain FX graph needs nothing compiled, and the recorder needs each
    node's direction as well.
    """

    def __init__(self, gm: fx.GraphModule, recorder: OpRecorder) -> None:
        super().__init__(gm)
        self.recorder = recorder

    def run_node(self, n: fx.Node) -> Any:
        self.recorder._node = n
        try:
            return super().run_node(n)
        finally:
            self.recorder._node = None


class OpRecorder:
    """A context manager that records the ops run on this thread, in order, as :class:`OpRecord`.

    ``placeholders`` names ops (``str(op)``) whose outputs are placeholders of no defined content,
    such as an exchange launch's receive slot. Their outputs are recorded without hashes. A subject's
    ``record_ops`` hook (harness/subject/protocol.py) adds its own before recording starts.
    ``capture`` asks for a clone of the outputs of the op with that index, in ``captured``.
    Set ``step`` before each training step to label its ops.
    """

    def __init__(self, *, placeholders: Collection[str] = (), capture: int | None = None) -> None:
        self.placeholders = frozenset(placeholders)
        self.capture = capture
        self.step: int | None = None
        self.records: list[OpRecord] = []
        self.captured: list[torch.Tensor] | None = None
        self._node: fx.Node | None = None
        self._module_of_grad_fn: dict[int, str] = {}
        self._writer: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> the last op that returned it
        self._count = 0
        self._mode: DebugMode | None = None
        self._exit = contextlib.ExitStack()

    def __enter__(self) -> OpRecorder:
        gc.freeze()  # what exists now is not the run's: the collection at the end need not scan it
        self._mode = self._exit.enter_context(
            DebugMode(record_nn_module=True, record_output=False, record_profiler_context=False)
        )
        self._exit.enter_context(DebugMode.log_tensor_hashes(hash_fn=content_digest))
        self._exit.enter_context(DebugMode.dispatch_hooks(log_hook=self._log))
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._exit.close()
            gc.collect()  # what is still alive now is what the run keeps
        finally:
            gc.unfreeze()
        persisting = set(self._writer.values())
        calls = [call for call in self._mode.operators if "op_index" in (call.log or {})]
        self.records = [self._record(call, persisting) for call in calls]
        self._mode, self._writer = None, WeakIdKeyDictionary()  # the call log holds argument strings for every op

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Its body runs unrecorded: a subject's one-off work inside a step that is not the step's own ops
        (tracing it, compiling it). The recorder's dispatch mode is set aside, and its module tracker's
        hooks, which autograd.grad under make_fx must not meet, come off until the body ends."""
        tracker = self._mode.module_tracker if self._mode is not None else None
        if tracker is not None:
            tracker.__exit__()
        try:
            with _disable_current_modes():
                yield
        finally:
            if tracker is not None:
                tracker.__enter__()

    def interpret(self, gm: fx.GraphModule) -> Callable[..., Any]:
        """``gm`` as a callable that runs it node by node, so that its ops get their nodes' module
        and direction (a graph is flat: no nn.Module runs inside it)."""
        return lambda *args: _NodeInterpreter(gm, self).run(*args)

    def _log(self, func: Any, types: Any, args: Any, kwargs: Any, result: Any) -> dict | None:
        """DebugMode's hook after every op it records: the op's place and outputs, kept in its log."""
        if getattr(func, "namespace", None) == "profiler":
            return None
        tensors = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        if self._count == self.capture:
            self.captured = [t.detach().clone() for t in tensors]
        read = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t in self._writer]
        module, backward = self._where()
        entry = {
            "op_index": self._count,
            "step": self.step,
            "where": (module, backward),
            "outputs": tuple(f"{dtype_abbrs[t.dtype]}[{', '.join(map(str, t.shape))}]" for t in tensors),
            "absmax": tuple(_absmax(t) for t in tensors),
            "inputs": tuple(dict.fromkeys(self._writer[t] for t in read)),
        }
        for t in tensors:
            self._writer[t] = self._count
        self._count += 1
        return entry

    def _where(self) -> tuple[str, bool]:
        """(module fqn, backward?) of the op now running."""
        if self._node is not None:
            return _innermost(self._node), bool(self._node.meta.get("autograd_backward", False))
        if torch._C._current_graph_task_id() != -1:  # inside autograd's backward
            node = torch._C._current_autograd_node()
            return (self._module_of_grad_fn.get(node._sequence_nr(), "") if node is not None else ""), True
        stack = self._mode.current_nn_module_stack
        # ModTracker names modules from the root's class ("DeepseekV3ForCausalLM.model.layers.1"): drop it.
        module = stack[-1].partition(".")[2] if stack else ""
        # The grad_fn an op makes takes the thread's next sequence number before the op runs.
        self._module_of_grad_fn.setdefault(torch.autograd._get_sequence_nr() - 1, module)
        return module, False

    def _record(self, call: Any, persisting: set[int]) -> OpRecord:
        log = call.log
        op = str(call.op)
        hashes = tuple(h for h in tree_leaves(log.get("hash")) if h is not None)
        in_flight = op.partition(".")[0] == IN_FLIGHT_NAMESPACE
        if in_flight or op in self.placeholders or len(hashes) != len(log["outputs"]):  # or uninitialised memory
            hashes, absmax = (None,) * len(log["outputs"]), (None,) * len(log["outputs"])
        else:
            absmax = log["absmax"]
        module, backward = log["where"]
        index = log["op_index"]
        return OpRecord(
            index, log["step"], op, module, backward, log["outputs"], hashes, absmax, log["inputs"], index in persisting
        )
