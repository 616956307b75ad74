"""torchtitan's own trainer as the system under test: a torchtitan arm with ``trainer = "torchtitan"``.

The model mode (:class:`harness.subject.torchtitan.TitanArm`) trains torchtitan's model in the
harness's loop, so a bug in torchtitan's trainer cannot reach a check. Here the arm builds
torchtitan's ``Trainer`` from torchtitan's own DeepSeek-V3 recipe (``deepseek_v3_debugmodel``) and
calls its ``train_step`` once per step: its parallelize (FSDP over the ranks, EP of degree ``ep``),
its loss normalised by the global count of valid tokens, its EP-aware gradient clipping, its
optimizer container with the MoE load-balancing pre-hook, and its LR schedule.

The harness changes the recipe only where it must:

- the model's shape is a reference model config (``model``), with SDPA attention
  (:func:`harness.oracles.torchtitan.titan_config`);
- the data are the synthetic batches of the model mode, through a torchtitan dataloader component
  (:class:`SyntheticBatches`), and no tokenizer files are read (:class:`NoTokenizer`);
- no checkpoints, no activation checkpointing, fp32 parameters in FSDP's compute.

It reads through torchtitan's extension points only: a metrics processor component (the loss and
grad norm torchtitan logs), an optimizer step pre-hook (the gradients, after clipping), and the
model's parameters and buffers after the step. The forward all-to-alls are taken as in the model
mode, by wrapping the dispatcher's exchange methods.

On CPU (gloo) three adjustments, each only there: torchtitan's device type reads "cuda" wherever no
accelerator is found, so its modules are told "cpu"; the SPMD backend is ``partial_dtensor`` (the
default fails on gloo's uneven all-to-all); FSDP reduces with SUM and divides after (gloo has no
PREMUL_SUM; torchtitan's divide factor is 1, so the bits are the same).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from harness.subject import protocol
from harness.subject.titan_config import (
    IN_FLIGHT_OPS,
    ExchangeEvents,
    TitanConfig,
    grad_or_zeros,
    synthetic_batch,
)

if TYPE_CHECKING:
    from harness.op_divergence import OpRecorder

CPU_DEVICE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.models.common.token_dispatcher",
)


def use_cpu() -> None:
    """Tell torchtitan's modules that the device is the CPU: each read its device type at import."""
    import importlib

    for name in CPU_DEVICE_MODULES:
        module = importlib.import_module(name)
        module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = torch.cpu


def _components() -> tuple[type, type, type]:
    """torchtitan's dataloader, tokenizer and metrics components the harness supplies, defined once
    torchtitan is importable (the ``torchtitan`` extra)."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.metrics import BaseLogger, DeviceMemStats, MetricsProcessor
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.tools.utils import NoColor

    class SyntheticBatches(BaseDataLoader):
        """The model mode's batches (:func:`synthetic_batch`), seeded by step and data-parallel rank."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            arm: TitanConfig | None = None
            vocab: int = 0

        def __init__(self, config: Config, *, dp_rank: int, **unused: Any) -> None:
            self.config, self.rank, self.step = config, dp_rank, 0

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            while True:
                self.step += 1
                inputs, labels = synthetic_batch(self.config.arm, self.config.vocab, self.step, self.rank)
                yield {"input": inputs}, labels

        def state_dict(self) -> dict[str, int]:
            return {"step": self.step}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.step = state["step"]

    class NoTokenizer(BaseTokenizer):
        """The batches are token ids already: no tokenizer files to read."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab: int = 0

        def __init__(self, config: Config, **unused: Any) -> None:
            super().__init__()
            self.vocab = config.vocab

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError("the synthetic batches are token ids")

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError("the synthetic batches are token ids")

        def get_vocab_size(self) -> int:
            return self.vocab

    class NoMemoryMonitor:
        """The device memory monitor's interface, zeros: torchtitan's reads CUDA's allocator."""

        device_name = "none"

        def get_peak_stats(self) -> DeviceMemStats:
            return DeviceMemStats(*([0] * len(DeviceMemStats._fields)))

        def reset_peak_stats(self) -> None:
            pass

    class RecordingMetrics(MetricsProcessor):
        """torchtitan's metrics processor, logging every step into ``logged`` (step -> loss, grad
        norm) instead of the console: the loss and grad norm as torchtitan's train_step reports them."""

        @dataclass(kw_only=True, slots=True)
        class Config(MetricsProcessor.Config):
            log_freq: int = 1

        def __init__(self, config: Config, *, parallel_dims: Any, **unused: Any) -> None:
            self.config, self.parallel_dims, self.logger = config, parallel_dims, BaseLogger()
            self.device_memory_monitor, self.color = NoMemoryMonitor(), NoColor()
            self.ntokens_since_last_log, self.data_loading_times = 0, []
            self.num_flops_per_token, self.optimizers, self.model_parts = -1, None, None
            self.logged: dict[int, tuple[float, float]] = {}

        def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float, **unused: Any):
            self.logged[step] = (global_avg_loss, grad_norm)
            self.ntokens_since_last_log = 0
            self.data_loading_times.clear()

        def close(self) -> None:
            pass

    return SyntheticBatches, NoTokenizer, RecordingMetrics


def trainer_config(config: TitanConfig, world: int, dump_folder: str) -> Any:
    """torchtitan's DeepSeek-V3 debug recipe with the arm's model, data, optimizer and parallelism."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    from harness.oracles import torchtitan as titan
    from harness.reference.model import get_config

    batches, tokenizer, metrics = _components()
    model = get_config(config.model)
    recipe = deepseek_v3_debugmodel()
    recipe.model_spec.model = titan.titan_config(model, comm_backend=config.moe_comm_backend)
    parallelize = recipe.model_spec.parallelize_fn
    if config.experts == "fp32":

        def parallelize_fp32(module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
            titan.fp32_experts(module)
            return parallelize(module, **kwargs)

        recipe.model_spec.parallelize_fn = parallelize_fp32
    recipe.hf_assets_path, recipe.dump_folder = "", dump_folder
    recipe.tokenizer = tokenizer.Config(vocab=model.vocab_size)
    recipe.dataloader = batches.Config(arm=config, vocab=model.vocab_size)
    recipe.metrics = metrics.Config()
    recipe.loss = CrossEntropyLoss.Config(global_vocab_size=model.vocab_size)
    recipe.optimizer = default_adamw(lr=config.lr)
    recipe.lr_scheduler.warmup_steps = config.warmup_steps
    recipe.checkpoint.enable = False
    recipe.activation_checkpoint = None
    training = recipe.training
    training.local_batch_size, training.seq_len, training.max_norm = config.local_batch, config.seq_len, config.max_norm
    training.mixed_precision_param, training.disable_cuda_graphs = "float32", True
    parallelism = recipe.parallelism
    parallelism.data_parallel_shard_degree = world
    parallelism.expert_parallel_degree = config.ep or world
    parallelism.spmd_backend = titan.SPMD_BACKEND
    recipe.debug.seed = config.seed
    recipe.debug.moe_force_load_balance = config.routing == "forced-balanced"
    return recipe


# GraphTrainer passes that read a GPU: the transformer-block bucketing pass estimates each node's runtime
# from the device's memory bandwidth (triton asks for a GPU driver), and the CUDA-graph pass captures.
GPU_ONLY_PASSES = ("joint_transformer_block_bucketing_reordering_pass", "cudagraph_pass")


def graph_trainer_config(recipe: Any, config: TitanConfig, device: str) -> Any:
    """torchtitan's GraphTrainer config of a Trainer recipe (its own ``to_graph_trainer_config``), with
    the arm's chunking: ``compile.mode`` is ``aot_fx_trace`` unless the arm runs eager chunking, which
    only wraps module forwards; ``compile.ep_overlap`` carries the strategy and the chunk roots."""
    from torchtitan.experiments.graph_trainer.configs import GraphTrainerCompileConfig, to_graph_trainer_config
    from torchtitan.experiments.graph_trainer.deepseek_v3 import model_registry

    graph = to_graph_trainer_config(recipe, model_registry)
    graph.compile = GraphTrainerCompileConfig(enable=True, mode="aot_fx_trace" if config.traced else None)
    if config.chunking != "none":
        overlap = graph.compile.ep_overlap
        overlap.enabled, overlap.module_fqn = True, config.chunk_root
        overlap.strategy = "graph" if config.chunking == "graph" else "eager"
        overlap.disable_early_grad_accumulation = not config.early_grad_accumulation
    if device == "cpu":
        graph.compile.disable_passes = list(GPU_ONLY_PASSES)
    if config.chunking == "graph":
        settle_unbacked_trace_inputs()
    return graph


def settle_unbacked_trace_inputs() -> None:
    """Graph chunking marks the batch dimension of the step's inputs unbacked; making them fake leaves
    their unbacked symbols pending, and torch 2.13's make_fx then binds them to the first node it
    records (the inputs' list) and asserts. The symbols belong to the inputs: settled once made fake."""
    from torchtitan.experiments.graph_trainer import make_fx_tracer

    fakeify = make_fx_tracer._fakeify_input
    if getattr(fakeify, "settles_unbacked", False):
        return

    def fakeify_settled(fake_mode: Any, *args: Any, **kwargs: Any) -> Any:
        fake = fakeify(fake_mode, *args, **kwargs)
        if fake_mode.shape_env is not None:
            fake_mode.shape_env.pending_fresh_unbacked_symbols.clear()
        return fake

    fakeify_settled.settles_unbacked = True
    make_fx_tracer._fakeify_input = fakeify_settled


def traced_collectives(gm: torch.fx.GraphModule) -> list[dict[str, Any]]:
    """The functional collectives of a traced step, with what torchtitan's tracer annotated them with."""
    collectives = []
    for node in gm.graph.nodes:
        op = str(node.target)
        if node.op != "call_function" or not op.startswith("_c10d_functional.") or "wait_tensor" in op:
            continue
        custom = node.meta.get("custom") or {}
        collectives.append(
            {
                "name": node.name,
                "op": op.split(".")[1],
                "phase": "bwd" if node.meta.get("autograd_backward") else "fwd",
                "module": custom.get("module_fqn"),
                "region": node.meta.get("chunked_region_fqn"),
                "chunk": node.meta.get("chunk_id"),
                "role": custom.get("EP"),
                "waited": any("wait_tensor" in str(user.target) for user in node.users),
            }
        )
    return collectives


class TitanTrainerArm(protocol.ArmBase):
    """This process's rank of an arm: torchtitan's Trainer, stepped by the harness."""

    def __init__(self, context: protocol.ArmContext) -> None:
        from torchtitan.trainer import Trainer

        from harness.oracles import torchtitan as titan
        from harness.reference.model import get_config

        self.config = TitanConfig(**context.arm.train)
        self.recorder = context.recorder
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if context.device == "cpu":
            use_cpu()
        self._dump = tempfile.TemporaryDirectory(prefix="torchtitan-")
        self._restore: list[Callable[[], None]] = []  # what record_ops replaced, put back at close
        self._graph: torch.fx.GraphModule | None = None  # a recorded traced step's graph, run interpreted
        recipe = trainer_config(self.config, self.world, self._dump.name)
        if self.config.trainer == "graph":
            from torchtitan.experiments.graph_trainer.trainer import GraphTrainer

            self.trainer = GraphTrainer(graph_trainer_config(recipe, self.config, context.device))
        else:
            self.trainer = Trainer(recipe)
        self.model = self.trainer.model_parts[0]
        if dist.get_backend() == "gloo":
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
        self.names = titan.Names(recipe.model_spec.model)
        self.cfg = get_config(self.config.model)
        self.moe_layers = [layer for layer in range(self.cfg.num_hidden_layers) if self.cfg.is_moe_layer(layer)]
        self.batches = self.trainer.batch_generator(self.trainer.dataloader)
        self.exchanges = ExchangeEvents(self.model, self.moe_layers, self.recorder, self.rank)
        if self.recorder is not None:
            self.trainer.optimizers.register_step_pre_hook(self._record_gradients)
            if context.arm.emits(protocol.TOKEN_EXCHANGE):
                self.exchanges.record()

    def _record_gradients(self, *unused: Any) -> None:
        """The gradients the optimizer is about to apply: reduced over the ranks, clipped."""
        self.recorder.gradients(self.rank, self.exchanges.step, self._named(grad_or_zeros))

    def step(self, step: int) -> protocol.StepRecord:
        start = time.perf_counter()
        self.exchanges.step = self.trainer.step = step
        self.trainer.train_step(self.batches)
        loss, grad_norm = self.trainer.metrics_processor.logged.pop(step)
        if self.recorder is not None:
            params = self._named(lambda p: p)
            balance = {name: t for name, t in self.model.named_buffers() if name.endswith("expert_bias_E")}
            update = protocol.RankUpdate(loss, grad_norm, balance, params)
            self.recorder.rank_update(self.rank, step, update)
        tokens = self.world * self.config.local_batch * self.config.seq_len
        return protocol.StepRecord(step, loss, grad_norm, tokens, time.perf_counter() - start)

    def _named(self, of: Any) -> dict[str, torch.Tensor]:
        """``of(parameter)`` for each of this rank's parameters (its FSDP and EP shards), under the
        reference's names."""
        local = {n: of(p) for n, p in self.model.named_parameters()}
        local = {n: t.to_local() if isinstance(t, DTensor) else t for n, t in local.items()}
        return self.names.from_titan({n: t.detach() for n, t in local.items()})

    def info(self) -> protocol.ArmFacts:
        return protocol.ArmFacts(moe_layers=tuple(self.moe_layers))

    def graph_export(self) -> dict[str, list[dict[str, Any]]]:
        """GRAPH, of a traced arm: each collective of torchtitan's traced step (its functional
        all-to-alls, all-gathers, reduce-scatters and all-reduces), in graph order, as torchtitan's own
        annotations place it: the module that issued it, forward or backward, its chunk and chunk
        region, its EP role (dispatch, combine), and whether a wait reads it."""
        return {"collectives": traced_collectives(self._graph or self.trainer._traced_step.gm)}

    def final_weights(self) -> Mapping[int, Mapping[str, torch.Tensor]]:
        return {self.rank: self._named(lambda p: p)}

    def record_ops(self, recorder: OpRecorder) -> None:
        """Readies the steps for ``recorder`` (the subject's ``record_ops``): each process one rank, its
        ops on this thread. A traced step's trace and graph passes run once, in step 1, unrecorded
        (their ops are fake, or compile); the graph then runs node by node through the recorder."""
        recorder.placeholders |= IN_FLIGHT_OPS
        if not self.config.traced:
            return
        from torchtitan.experiments.graph_trainer import trainer as graph_trainer

        trace, passes = graph_trainer.minimal_fx_tracer, graph_trainer.apply_graph_passes

        def unrecorded(call: Any) -> Any:
            def run(*args: Any, **kwargs: Any) -> Any:
                with recorder.paused():
                    return call(*args, **kwargs)

            return run

        def interpreted(*args: Any, **kwargs: Any) -> Any:
            self._graph = unrecorded(passes)(*args, **kwargs)
            return recorder.interpret(self._graph)

        graph_trainer.minimal_fx_tracer = lambda *a, **k: unrecorded(trace(*a, **k))
        graph_trainer.apply_graph_passes = interpreted
        self._restore.append(lambda: setattr(graph_trainer, "minimal_fx_tracer", trace))
        self._restore.append(lambda: setattr(graph_trainer, "apply_graph_passes", passes))

    def close(self) -> None:
        for restore in self._restore:
            restore()
        self.trainer.close()
        self._dump.cleanup()
