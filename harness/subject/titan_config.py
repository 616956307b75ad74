"""What both modes of the torchtitan subject share (torchtitan.py trains torchtitan's model in the
harness's loop, titan_trainer.py runs torchtitan's own Trainer): an arm's configuration, its synthetic
data, and the token-exchange events taken from torchtitan's all-to-all dispatcher."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.subject import protocol

ROUTINGS = ("learned", "forced-balanced")
EXPERTS = ("bf16", "fp32")
TRAINERS = ("torchtitan", "graph", "model")
# torchtitan's EP-overlap chunking in its GraphTrainer (experiments/graph_trainer): "none"; "eager", its
# module forwards wrapped in two chunks and run eagerly; "eager-traced", the same traced by make_fx;
# "graph", the unchunked step traced and chunked by its FX pass. Its chunk roots: every transformer
# block with an MoE, or every MoE block.
CHUNKINGS = ("none", "eager", "eager-traced", "graph")
CHUNK_ROOTS = ("layers.*", "layers.*.moe")
# torchtitan's token dispatchers (its moe_comm_backend): "standard" is its all-to-all, local dispatch at
# EP 1; the others need CUDA (DeepEP's and HybridEP's kernels, MinimalAsyncEP's symmetric memory).
COMM_BACKENDS = ("standard", "deepep", "hybridep", "minimal_async_ep")


@dataclass(frozen=True)
class TitanConfig:
    """One arm: who trains (torchtitan's Trainer, or the harness's loop around torchtitan's model), the
    model's shape (a reference model config), routing, data, optimizer and expert parallelism."""

    trainer: str = "torchtitan"  # torchtitan's Trainer (titan_trainer.py), its GraphTrainer ("graph"), or "model"
    model: str = "cpu-tiny"  # a reference model config name (harness.reference.model.CONFIGS)
    routing: str = "learned"  # or torchtitan's round-robin "forced-balanced"
    experts: str = "bf16"  # torchtitan's routed experts as shipped, or "fp32"
    local_batch: int = 4
    seq_len: int = 32
    lr: float = 1e-3
    max_norm: float = 1.0
    warmup_steps: int = 2  # torchtitan's LR warmup (its debug recipe's); the model mode's LR is constant
    ep: int = 0  # the trainer's expert-parallel degree; 0: every rank (the model mode's only layout)
    moe_comm_backend: str = "standard"  # the trainer's token dispatcher (COMM_BACKENDS)
    chunking: str = "none"  # the GraphTrainer's EP-overlap chunking (CHUNKINGS)
    chunk_root: str = "layers.*"  # its chunk roots, torchtitan's module pattern (CHUNK_ROOTS)
    # graph chunking sums the chunks' parameter gradients before FSDP reduces them (torchtitan's default);
    # false: each chunk's reduced apart, as eager chunking does (its disable_early_grad_accumulation)
    early_grad_accumulation: bool = True
    seed: int = 42

    def __post_init__(self) -> None:
        if self.trainer not in TRAINERS:
            raise ValueError(f"trainer must be one of {TRAINERS}, got {self.trainer!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.experts not in EXPERTS:
            raise ValueError(f"experts must be one of {EXPERTS}, got {self.experts!r}")
        if self.moe_comm_backend not in COMM_BACKENDS:
            raise ValueError(f"moe_comm_backend must be one of {COMM_BACKENDS}, got {self.moe_comm_backend!r}")
        if self.moe_comm_backend != "standard" and self.trainer == "model":
            raise ValueError("moe_comm_backend: the model mode exchanges through the standard all-to-all only")
        if self.chunking not in CHUNKINGS:
            raise ValueError(f"chunking must be one of {CHUNKINGS}, got {self.chunking!r}")
        if self.chunk_root not in CHUNK_ROOTS:
            raise ValueError(f"chunk_root must be one of {CHUNK_ROOTS}, got {self.chunk_root!r}")
        if self.chunking != "none" and self.trainer != "graph":
            raise ValueError(
                f'chunking: torchtitan chunks in its GraphTrainer (trainer = "graph"), not {self.trainer!r}'
            )
        if not self.early_grad_accumulation and self.chunking != "graph":
            raise ValueError("early_grad_accumulation: only torchtitan's graph chunking accumulates early")
        if self.ep < 0 or (self.ep and self.trainer == "model"):
            raise ValueError(f"ep is torchtitan's trainer's expert-parallel degree (0: every rank), got {self.ep}")
        from harness.reference.model import CONFIGS

        if self.model not in CONFIGS:
            raise ValueError(f"model must be one of {sorted(CONFIGS)}, got {self.model!r}")
        cfg = CONFIGS[self.model]
        if cfg.rope_type != "default":
            raise ValueError(f"model {self.model}: torchtitan does not scale cos/sin for {cfg.rope_type}")

    @property
    def traced(self) -> bool:
        """Whether torchtitan traces the step (its GraphTrainer's ``aot_fx_trace``): the Python of its
        modules then runs once, at the trace, and never again."""
        return self.trainer == "graph" and self.chunking != "eager"


# torchtitan's functional collectives return their output at once and fill it in the background
# until its wait_tensor: a recorder hashes the wait's output, not theirs.
IN_FLIGHT_OPS = frozenset(
    f"_c10d_functional.{name}.default"
    for name in ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
)


def synthetic_batch(config: TitanConfig, vocab: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform token ids seeded by (seed, step, rank): every process derives its own batch."""
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step * 8_191 + rank)
    tokens = torch.randint(vocab, (config.local_batch, config.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def grad_or_zeros(param: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient; zeros for one the loss did not reach."""
    return param.grad if param.grad is not None else torch.zeros_like(param)


class ExchangeEvents:
    """A launch event around each MoE layer's forward dispatch and combine all-to-all of torchtitan's
    ``AllToAllTokenDispatcher`` (rows sent to and received from each rank), taken by wrapping its
    exchange methods; ``step`` is the step the events belong to, set by the arm. Under eager chunking a
    layer's dispatcher runs once per chunk in a step, in chunk order: the event carries the chunk."""

    def __init__(self, model: torch.nn.Module, layers: list[int], recorder: protocol.Recorder | None, rank: int):
        self.model, self.layers, self.recorder, self.rank = model, layers, recorder, rank
        self.step, self._seq = 0, 0
        self._chunks: dict[tuple[int, int, str], int] = {}  # (step, layer, kind) -> exchanges so far

    def record(self) -> None:
        for layer in self.layers:
            dispatcher = self.model.layers[str(layer)].moe.routed_experts.token_dispatcher
            dispatch, combine = dispatcher._dispatch_token_exchange, dispatcher._combine_token_exchange

            def dispatched(x, pg, output_splits, input_splits, layer=layer, send=dispatch):
                self._launch("dispatch", layer, input_splits, output_splits)
                return send(x, pg, output_splits, input_splits)

            def combined(x, pg, input_splits, output_splits, layer=layer, send=combine):
                self._launch("combine", layer, output_splits, input_splits)
                return send(x, pg, input_splits, output_splits)

            dispatcher._dispatch_token_exchange = dispatched
            dispatcher._combine_token_exchange = combined

    def _launch(self, name: str, layer: int, send: list[int], recv: list[int]) -> None:
        if self._chunks and next(iter(self._chunks))[0] != self.step:
            self._chunks.clear()
        key = (self.step, layer, name)
        chunk = self._chunks[key] = self._chunks.get(key, -1) + 1
        event = {
            "step": self.step,
            "phase": "fwd",
            "layer": layer,
            "chunk": chunk,
            "kind": name,
            "op": "launch",
            "name": name,
            "buffer_set": 0,  # torchtitan allocates each exchange's output: no sets to rotate
            "seq": self._seq,
            "rows": sum(recv),
            "send_counts": list(send),
            "recv_counts": list(recv),
        }
        self._seq += 1
        self.recorder.exchange_event(self.rank, event)
