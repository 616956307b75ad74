"""The training step of the reference, and the seam the harness drives.

A :class:`Trainer` is built in every process of a run. It hosts the logical EP ranks of its
process (data parallel = expert parallel, as in torchtitan's dp_shard=ep), one model replica and
one thread each. A step runs forward, loss and backward on every logical rank, sums the replicated
gradients over logical ranks in logical-rank order, clips by the global norm and steps AdamW.
The traced chunkings run forward, loss and backward as one FX graph, traced once when the
Trainer is built (see :mod:`harness.reference.chunking.graph_step`); the rest of the step is shared.
Loss and grad norm are reduced the same canonical way, so they are identical on every process
and bitwise independent of how many processes host the EP group.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

# torch.distributed.nn.functional binds ``group=group.WORLD`` as default arguments when it is first
# imported; torch._dynamo imports it (tracing does), and so does torch.use_deterministic_algorithms
# (through torch._inductor.config). Imported after init_process_group, it would hold the default
# gloo group for good: destroy_process_group no longer frees it, its worker threads outlive the
# interpreter, and one still releasing a collective's tensors at shutdown calls std::terminate
# (SIGABRT after all the work is done). Imported here, before any process group exists, the
# defaults bind None; this module alone costs milliseconds, where torch._dynamo costs a second.
import torch.distributed.nn.functional  # noqa: F401

from harness.reference.chunking import FAULTS
from harness.reference.chunking.eager import SPLIT_DIMS, apply_eager_chunking
from harness.reference.chunking.schedule import EPScheduler
from harness.reference.ep.exchange import EventSink, TokenExchange, bind
from harness.reference.ep.group import LogicalGroup
from harness.reference.model import (
    ROUTER_FAULTS,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MLAttention,
    causal_lm_loss,
    get_config,
)

if TYPE_CHECKING:
    from harness.reference.chunking.graph_step import GraphStep
    from harness.reference.chunking.trace_cache import GraphCache

ROUTINGS = ("forced-balanced", "learned")
# "eager-traced" and "graph" run one traced train step (forward, loss, backward) per rank instead
# of eager autograd: eager chunking then traced, or the unchunked model traced then graph-chunked.
CHUNKINGS = ("none", "eager", "eager-traced", "graph")
TRACED = ("eager-traced", "graph")
ATTENTION = "model.layers.*.self_attn"
# Called with (logical rank, step, {param name: gradient}) once gradients are final, before clipping.
GradSink = Callable[[int, int, dict], None]
# Called under bf16-mixed with (logical rank, step, the replicated gradients as summed over logical
# ranks, every logical rank's own gradients summed again in fp32), both flat in parameter order:
# what lets a caller check that the sum was taken in fp32, as the design says, which nothing else shows
# (every arm sums alike, and bf16's rounding hides within any tolerance against an oracle).
SumSink = Callable[[int, int, torch.Tensor, torch.Tensor], None]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# "pure": every tensor in ``dtype``, optimizer state included. "bf16-mixed", as GPUs train: fp32
# master weights, optimizer state, gradients (and their reduction), loss and grad norm; the forward
# under bf16 autocast, the router in fp32, tokens exchanged in bf16.
PRECISIONS = ("pure", "bf16-mixed")


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines one arm's training run."""

    model: str = "cpu-tiny"  # a name in model.CONFIGS
    # DeepseekV3Config fields replacing the named config's (a shrunk checkpoint config, --set model.X)
    model_overrides: dict[str, Any] = field(default_factory=dict)
    ep: int = 2  # logical EP degree, also the data-parallel degree
    seed: int = 42
    routing: str = "forced-balanced"
    local_batch: int = 4
    seq_len: int = 32
    lr: float = 1e-3
    max_norm: float = 1.0
    chunking: str = "none"
    chunks: int = 2
    chunk_roots: str = "moe"
    chunk_dim: str = "batch"
    num_buffer_sets: int = 2
    device: str = "cpu"
    dtype: str = "float32"
    precision: str = "pure"  # PRECISIONS
    # A deliberate bug the checks must catch: a graph pass broken (graph_step.FAULTS, graph arms
    # only), or a router bug (ROUTER_FAULTS: its fp32 upcast dropped, bf16-mixed only; the routed
    # scaling factor applied twice, which only an oracle sees: every arm would apply it twice).
    fault: str = "none"
    compile_attention: bool = False  # regional Inductor: only the attention modules are compiled
    # A planted bug of the checkpoint (harness.reference.checkpoint) for a resumed arm: one of
    # checkpoint_faults(), each named for what the save leaves out or the load loses.
    checkpoint_fault: str = "none"

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.chunking not in CHUNKINGS:
            raise ValueError(f"chunking must be one of {CHUNKINGS}, got {self.chunking!r}")
        if self.checkpoint_fault not in ("none", *self.checkpoint_faults()):
            raise ValueError(
                f"checkpoint_fault must be one of {('none', *self.checkpoint_faults())} for this arm's trainer,"
                f" got {self.checkpoint_fault!r}"
            )
        if self.fault not in (*FAULTS, *ROUTER_FAULTS):
            raise ValueError(f"fault must be one of {(*FAULTS, *ROUTER_FAULTS)}, got {self.fault!r}")
        if self.fault in FAULTS and self.fault != "none" and self.chunking != "graph":
            raise ValueError(f"fault {self.fault!r} breaks a graph pass: it needs chunking = 'graph'")
        if self.fault == "router-upcast-dropped" and self.precision != "bf16-mixed":
            raise ValueError(f"fault {self.fault!r} shows in bf16 compute only: it needs precision = 'bf16-mixed'")
        if self.chunking in TRACED and self.routing != "forced-balanced":
            raise ValueError(
                f"chunking {self.chunking!r} traces static exchange sizes: it needs forced-balanced routing"
            )
        if self.compile_attention and self.chunking in TRACED and self.chunk_roots == "block":
            raise ValueError(
                "compile_attention of a traced arm needs chunk_roots = 'moe': attention must stay unchunked"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.precision == "bf16-mixed" and self.dtype != "float32":
            raise ValueError("precision 'bf16-mixed' keeps fp32 master weights: it needs dtype = 'float32'")
        if self.precision == "bf16-mixed" and type(self) is not TrainConfig:
            raise ValueError("precision 'bf16-mixed' runs on the plain trainer, not the delayed pipeline or PEC")
        if self.ep < 1 or self.chunks < 1 or self.num_buffer_sets < 1:
            raise ValueError("ep, chunks and num_buffer_sets must be >= 1")
        n_experts = self.model_config().n_routed_experts
        if n_experts % self.ep:
            raise ValueError(f"EP degree {self.ep} does not divide the {n_experts} routed experts of {self.model}")

    def checkpoint_faults(self) -> tuple[str, ...]:
        """The planted checkpoint bugs that apply to this config's trainer: the AdamW state left out,
        the data position lost (plain training only: the versioned and PEC trainers count their own
        batches, and the checkpoint holds their counters)."""
        return ("optimizer-not-saved", "data-position-lost")

    def model_config(self) -> DeepseekV3Config:
        """The model this arm trains: the named config with the overrides applied."""
        return get_config(self.model, **self.model_overrides)

    @property
    def mixed(self) -> bool:
        return self.precision == "bf16-mixed"

    def compute(self, device: torch.device) -> torch.autocast:
        """The forward's numerics: bf16 autocast under bf16-mixed, else the weights' own dtype.
        Backward runs outside it, as autocast asks. No cast cache: a weight used by every chunk is
        cast at each use, so its chunks' gradients meet in fp32, in eager and traced arms alike
        (a traced step's weights are graph inputs, which autocast never caches)."""
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.mixed, cache_enabled=False)

    @property
    def exchange_dtype(self) -> torch.dtype:
        """What tokens travel in: bf16 under bf16-mixed (the experts compute in it anyway)."""
        return torch.bfloat16 if self.mixed else DTYPES[self.dtype]


def set_determinism(device: str) -> None:
    """Deterministic kernels everywhere; one intra-op thread per CPU rank."""
    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def enter_rank_thread(device: torch.device) -> None:
    """Called first on a logical rank's pool thread: a new thread's current GPU is cuda:0, whatever
    its process drives, so a rank hosted by a process with LOCAL_RANK >= 1 would allocate there."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def accelerator_identity(device: torch.device) -> dict | None:
    """What a traced graph depends on beyond the device index (its trace cache key): the GPU model
    and compute capability, since the attention backend is fixed into the graph at trace time; None
    on the CPU, whose kernel ISA the harness pins."""
    if device.type != "cuda":
        return None
    return {"name": torch.cuda.get_device_name(device), "capability": list(torch.cuda.get_device_capability(device))}


def synthetic_batch(config: TrainConfig, vocab: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable stream (each row counts up by its own stride), seeded by (seed, step, rank)."""
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step * 8_191 + rank)
    start = torch.randint(vocab, (config.local_batch, 1), generator=gen)
    stride = torch.randint(1, 8, (config.local_batch, 1), generator=gen)
    tokens = (start + stride * torch.arange(config.seq_len + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


@dataclass(frozen=True)
class RankUpdate:
    """One logical rank right after its optimizer step: its own view of the step's global loss and
    grad norm, and its live parameters, by Hugging Face name. The replicated ones must be equal
    on every logical rank; only a bug (or a lost update) makes one drift."""

    loss: float
    grad_norm: float
    replicated: dict[str, torch.Tensor]
    experts: dict[str, torch.Tensor]  # this rank's shard of the routed experts


# Called with (logical rank, step, update) on that rank's thread once its optimizer step is done.
UpdateSink = Callable[[int, int, RankUpdate], None]


class _Replica:
    """One logical rank: its model (dense weights replicated, its own experts), optimizer, exchange."""

    def __init__(
        self,
        config: TrainConfig,
        group: LogicalGroup,
        rank: int,
        device: torch.device,
        sink: EventSink | None,
        prepare_model: Callable[[int, DeepseekV3ForCausalLM], None],
    ) -> None:
        cfg = config.model_config()
        self.model = DeepseekV3ForCausalLM(
            cfg,
            ep_rank=rank,
            ep_size=config.ep,
            forced_balanced=config.routing == "forced-balanced",
            router_fault=config.fault if config.fault in ROUTER_FAULTS else "none",
        )
        self.model.init_weights(torch.Generator().manual_seed(config.seed))
        prepare_model(rank, self.model)
        self.model.to(device=device, dtype=DTYPES[config.dtype])
        if config.compile_attention and config.chunking not in TRACED:  # traced arms compile graph regions
            for module in self.model.modules():
                if isinstance(module, MLAttention):
                    module.compile()
        if config.chunking in ("eager", "eager-traced"):
            apply_eager_chunking(
                self.model,
                chunks=config.chunks,
                roots=config.chunk_roots,
                split=config.chunk_dim,
                scheduler=EPScheduler(config.num_buffer_sets),
            )
        # The clone-forward-only fault exchanges whole batches in backward.
        whole = config.chunking == "none" or config.fault == "clone-forward-only"
        tokens = config.local_batch * config.seq_len // (1 if whole else config.chunks)
        rows = tokens * cfg.num_experts_per_tok
        # Forced-balanced routing fixes the receive size exactly; learned routing may send a rank everything.
        capacity = rows if config.routing == "forced-balanced" else rows * config.ep
        self.exchange = TokenExchange(
            group,
            rank,
            hidden=cfg.hidden_size,
            capacity=capacity,
            num_buffer_sets=config.num_buffer_sets,
            dtype=config.exchange_dtype,
            device=device,
            event_sink=sink,
        )
        # Parameters autograd trains; a frozen one (PEC's embedding shard) has its own optimizer.
        named = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.expert_params = self.model.expert_parameters()
        expert_ids = {id(p) for p in self.expert_params}
        self.dense_params = [p for p in named.values() if id(p) not in expert_ids]
        self.named_dense = {n: p for n, p in named.items() if id(p) not in expert_ids}
        self.named_experts = {n: p for n, p in named.items() if id(p) in expert_ids}
        self.params = list(named.values())
        self.buffers = list(self.model.buffers())
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, foreach=False)


class Trainer:
    """Drives the logical EP ranks of this process through training steps."""

    def __init__(
        self,
        config: TrainConfig,
        event_sink: EventSink | None = None,
        grad_sink: GradSink | None = None,
        update_sink: UpdateSink | None = None,
        trace_cache: GraphCache | None = None,
        sum_sink: SumSink | None = None,
    ) -> None:
        set_determinism(config.device)
        self.config = config
        self.trace_cache = trace_cache
        self.grad_sink = grad_sink
        self.update_sink = update_sink
        self.sum_sink = sum_sink
        self.group = LogicalGroup(config.ep)
        self.logical_ranks = self.group.local_ranks
        self.device = self._device()
        self.cfg = config.model_config()
        self.replicas = {
            r: _Replica(config, self.group, r, self.device, event_sink, self._prepare_model) for r in self.logical_ranks
        }
        self.moe_layers = self.replicas[self.logical_ranks[0]].model.moe_layers
        self.graph_step = self._build_graph_step() if config.chunking in TRACED else None
        self._threads = ThreadPoolExecutor(len(self.logical_ranks)) if len(self.logical_ranks) > 1 else None

    def _prepare_model(self, rank: int, model: DeepseekV3ForCausalLM) -> None:
        """Called on each logical rank's freshly initialised model, before chunking and the optimizer:
        where a subclass swaps in a module of its own (PEC's sharded embedding)."""

    def in_flight_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """What a checkpoint must hold beyond the models, AdamW and the step, per logical rank:
        nothing for plain training, which finishes every batch within its step. A pipelined trainer
        returns the work it holds between steps (harness.reference.checkpoint)."""
        return {}

    def load_in_flight(self, state: dict[int, dict[str, torch.Tensor]]) -> None:
        """Restores what :meth:`in_flight_state` returned (nothing here)."""

    def _device(self) -> torch.device:
        """The process's current GPU, as its launcher set it (the harness's rank: by LOCAL_RANK among
        the visible GPUs), or the CPU."""
        if self.config.device != "cuda":
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def _build_graph_step(self) -> GraphStep:
        """Traced once, from the first local replica (or loaded from the trace cache); every replica
        runs it with its own tensors."""
        # Imported here: tracing brings sympy and FX's symbolic shapes, which a process that trains
        # eagerly, or only validates configs (the harness's), does without.
        from harness.reference.chunking.graph_step import GraphPasses, build_graph_step

        config = self.config
        rank = self.logical_ranks[0]
        batch = [t.to(self.device) for t in synthetic_batch(config, self.cfg.vocab_size, 0, rank)]
        passes = GraphPasses(
            chunks=config.chunks,
            chunk_roots=config.chunk_roots,
            num_buffer_sets=config.num_buffer_sets,
            fault=config.fault if config.fault in FAULTS else "none",  # a router fault is the model's
            inductor_pattern=ATTENTION if config.compile_attention else None,
        )
        cache = None
        if self.trace_cache is not None:
            trainer = f"{type(self).__module__}.{type(self).__qualname__}"
            identity = {
                "config": asdict(config),
                "rank": rank,
                "device": str(self.device),
                "accelerator": accelerator_identity(self.device),
            }
            cache = self.trace_cache.slot(trainer=trainer, **identity)

        def loss_fn(model: DeepseekV3ForCausalLM, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            with config.compute(self.device):  # traced into the graph as explicit casts
                return causal_lm_loss(model(inputs), labels)

        return build_graph_step(
            self.replicas[rank].model,
            batch,
            loss_fn,
            passes,
            mode=config.chunking,
            chunk_dim=SPLIT_DIMS[config.chunk_dim],
            loss_divisor=config.ep,
            cache=cache,
        )

    @property
    def graph_export(self) -> dict | None:
        """The traced graph's exchange ops as plain data (None for eager arms); see ``export_exchange_graph``."""
        return self.graph_step.exported if self.graph_step else None

    @property
    def graph_build(self) -> dict | None:
        """Where the traced graph came from and what building it cost (None for eager arms); see ``GraphStep.build``."""
        return self.graph_step.build if self.graph_step else None

    def step(self, step: int) -> dict:
        start = time.perf_counter()
        results = self._on_every_rank(lambda rank: self._rank_step(rank, step))
        loss, grad_norm = results[self.logical_ranks[0]]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "tokens": self.config.ep * self.config.local_batch * self.config.seq_len,
            "step_time_s": time.perf_counter() - start,
        }

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown()

    def _on_every_rank(self, fn: Callable[[int], tuple[float, float]]) -> dict[int, tuple[float, float]]:
        if self._threads is None:
            return {r: fn(r) for r in self.logical_ranks}

        def guarded(rank: int) -> tuple[float, float]:
            enter_rank_thread(self.device)
            # Backward of CUDA ops must stay on this thread, or the logical ranks' exchanges
            # would queue behind each other on autograd's single device thread.
            with torch.autograd.set_multithreading_enabled(False):
                try:
                    return fn(rank)
                except BaseException as exc:
                    self.group.abort(exc)
                    raise

        futures = {r: self._threads.submit(guarded, r) for r in self.logical_ranks}
        return {r: f.result() for r, f in futures.items()}

    def _rank_step(self, rank: int, step: int) -> tuple[float, float]:
        replica = self.replicas[rank]
        replica.exchange.step = step
        inputs, labels = synthetic_batch(self.config, self.cfg.vocab_size, step, rank)
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        with bind(replica.exchange):
            if self.graph_step is None:
                with self.config.compute(self.device):
                    loss = causal_lm_loss(replica.model(inputs), labels)
                (loss / self.config.ep).backward()
            else:
                loss, grads = self.graph_step(replica.params, replica.buffers, inputs, labels)
                for p, g in zip(replica.params, grads):
                    p.grad = g.contiguous()  # the layout eager autograd gives a fresh .grad
        self._reduce_gradients(rank, step)
        grad_norm = self._optimizer_step(rank)
        return self._finish_step(rank, step, loss, grad_norm)

    def _reduce_gradients(self, rank: int, step: int) -> None:
        """Sum the replicated gradients over logical ranks (data parallel) and hand them to the grad
        sink; to the sum sink, the sum beside the ranks' own gradients gathered and summed again in
        fp32, in logical-rank order, apart from the sum's own code."""
        replica = self.replicas[rank]
        own = self._dense_grads(replica) if self.sum_sink is not None else None
        self._sum_dense_grads(rank, replica)
        if self.sum_sink is not None:
            resum = torch.stack(self.group.all_gather(rank, own.float())).sum(0)
            self.sum_sink(rank, step, self._dense_grads(replica), resum)
        if self.grad_sink is not None:
            self.grad_sink(rank, step, {n: p.grad for n, p in replica.model.named_parameters() if p.requires_grad})

    def _optimizer_step(self, rank: int) -> torch.Tensor:
        """Clip by the global norm, step AdamW, drop the gradients; returns the norm before clipping."""
        replica = self.replicas[rank]
        grad_norm = self._clip_by_global_norm(rank, replica)
        replica.optimizer.step()
        replica.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _finish_step(self, rank: int, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, float]:
        """The step's global loss (this rank's loss summed over logical ranks in order), reported with the norm."""
        losses = self.group.all_gather(rank, loss.detach().float().reshape(()))
        global_loss = float(torch.stack(losses).sum() / self.config.ep)
        self._report_update(rank, step, global_loss, float(grad_norm))
        return global_loss, float(grad_norm)

    def _report_update(self, rank: int, step: int, loss: float, grad_norm: float) -> None:
        if self.update_sink is not None:
            replica = self.replicas[rank]
            self.update_sink(rank, step, RankUpdate(loss, grad_norm, replica.named_dense, replica.named_experts))

    @staticmethod
    def _dense_grads(replica: _Replica) -> torch.Tensor:
        """The replicated parameters' gradients as one flat copy, in parameter order."""
        return torch.cat([p.grad.flatten() for p in replica.dense_params])

    def _sum_dense_grads(self, rank: int, replica: _Replica) -> None:
        total = self.group.sum(rank, self._dense_grads(replica))
        for p, g in zip(replica.dense_params, total.split([p.numel() for p in replica.dense_params])):
            p.grad.copy_(g.view_as(p))

    def _clip_by_global_norm(self, rank: int, replica: _Replica) -> torch.Tensor:
        dense = torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in replica.dense_params])
        experts = torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in replica.expert_params])
        per_rank_experts = self.group.all_gather(rank, experts)
        norm = torch.linalg.vector_norm(torch.cat([dense, *per_rank_experts]))
        scale = (self.config.max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in replica.params:
            p.grad.mul_(scale.to(p.grad.dtype))
        return norm


def print_trajectory(config: TrainConfig, steps: int, timing: bool = False) -> None:
    """Train for ``steps`` and print ``{step, loss, grad_norm}`` JSON lines (exact floats) on rank 0."""
    fields = ("step", "loss", "grad_norm", "step_time_s") if timing else ("step", "loss", "grad_norm")
    if config.device == "cuda":  # one GPU per local rank, or the one a task sees
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    if "RANK" in os.environ:
        dist.init_process_group("gloo" if config.device == "cpu" else "nccl")
    trainer = Trainer(config)
    try:
        for step in range(steps):
            record = trainer.step(step)
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(json.dumps({k: record[k] for k in fields}), flush=True)
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
