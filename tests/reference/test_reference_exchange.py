"""Token exchange: forced-balanced routing, launch/wait events, buffer-set hazard, graph visibility."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from harness.reference.chunking.eager import apply_eager_chunking
from harness.reference.chunking.schedule import EPScheduler
from harness.reference.ep import ops
from harness.reference.ep.exchange import TokenExchange, bind
from harness.reference.ep.group import LogicalGroup
from harness.reference.model import DeepseekV3ForCausalLM, causal_lm_loss, get_config
from harness.reference.train import TrainConfig, Trainer, synthetic_batch


def test_forced_balanced_routing_gives_every_expert_the_same_count() -> None:
    cfg = get_config("cpu-tiny")

    def router(forced_balanced: bool) -> torch.nn.Module:
        model = DeepseekV3ForCausalLM(cfg, forced_balanced=forced_balanced)
        model.init_weights(torch.Generator().manual_seed(0))
        return model.model.layers[1].mlp.gate

    x = torch.randn(64, cfg.hidden_size)
    ids, weights = router(True)(x)
    counts = torch.bincount(ids.flatten(), minlength=cfg.n_routed_experts)
    assert counts.tolist() == [64 * cfg.num_experts_per_tok // cfg.n_routed_experts] * cfg.n_routed_experts
    assert weights.requires_grad  # scores are still gathered, so the router keeps learning
    learned_ids, _ = router(False)(x)
    assert len(set(torch.bincount(learned_ids.flatten(), minlength=cfg.n_routed_experts).tolist())) > 1


def run_one_step(config: TrainConfig) -> list[dict]:
    events: list[dict] = []
    trainer = Trainer(config, event_sink=lambda rank, e: events.append({**e, "rank": rank}) if rank == 0 else None)
    trainer.step(0)
    trainer.close()
    return events


def test_one_dispatch_and_one_combine_launch_per_layer_chunk_and_phase_each_waited_once() -> None:
    events = run_one_step(TrainConfig(ep=2, chunking="eager", chunks=2))
    moe_layers = [1, 2]
    launches = Counter((e["phase"], e["layer"], e["chunk"], e["kind"]) for e in events if e["op"] == "launch")
    expected = {
        (ph, layer, c, k): 1
        for ph in ("fwd", "bwd")
        for layer in moe_layers
        for c in (0, 1)
        for k in ("dispatch", "combine")
    }
    assert launches == expected
    open_launches: dict = {}
    for e in events:
        key = (e["phase"], e["layer"], e["chunk"], e["kind"])
        if e["op"] == "launch":
            open_launches[key] = e["seq"]
        else:
            assert open_launches.pop(key) < e["seq"], f"wait before its launch at {key}"
    assert not open_launches
    # Forward chunks in order with the next chunk's launch before this chunk's wait; backward reversed.
    fwd = [(e["chunk"], e["kind"], e["op"]) for e in events if e["phase"] == "fwd" and e["layer"] == 1]
    assert fwd[:4] == [
        (0, "dispatch", "launch"),
        (1, "dispatch", "launch"),
        (0, "dispatch", "wait"),
        (0, "combine", "launch"),
    ]
    for kind in ("dispatch", "combine"):
        bwd = [
            e["chunk"]
            for e in events
            if e["phase"] == "bwd" and e["layer"] == 1 and e["op"] == "launch" and e["kind"] == kind
        ]
        assert bwd == [1, 0]
    assert {e["buffer_set"] for e in events if e["chunk"] == 1} == {1}


class OneBufferSetScheduler(EPScheduler):
    """Overlaps like two buffer sets but hands every chunk set 0: the bug the harness must catch."""

    def buffer_set(self, chunk: int) -> int:
        return 0


def losses(config: TrainConfig, scheduler: EPScheduler | None = None) -> list[float]:
    trainer = Trainer(config)
    if scheduler is not None:
        for replica in trainer.replicas.values():
            apply_eager_chunking(replica.model, chunks=config.chunks, scheduler=scheduler)
    out = [trainer.step(s)["loss"] for s in range(2)]
    trainer.close()
    return out


def test_reusing_one_buffer_set_for_two_exchanges_in_flight_corrupts_the_numerics() -> None:
    config = TrainConfig(ep=2, chunking="eager", chunks=2)
    correct = losses(config)
    assert losses(config, EPScheduler(2)) == correct  # re-applying chunking alone changes nothing
    assert losses(config, OneBufferSetScheduler(2)) != correct


def test_launch_and_wait_ops_survive_make_fx_and_dead_code_elimination() -> None:
    group = LogicalGroup(1)
    exchange = TokenExchange(
        group, 0, hidden=4, capacity=8, num_buffer_sets=2, dtype=torch.float32, device=torch.device("cpu")
    )
    counts = torch.tensor([8])

    def fn(x: torch.Tensor) -> torch.Tensor:
        ops.wait_dispatch(ops.dispatch(x, counts, counts, 8, 1), 1)  # result unused on purpose
        return x * 2

    with bind(exchange):
        gm = make_fx(fn)(torch.randn(8, 4))
    gm.graph.eliminate_dead_code()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.harness_ep.dispatch.default in targets
    assert torch.ops.harness_ep.wait_dispatch.default in targets
    for target in ops.LAUNCH_OVERLOADS:
        assert "buffer_set" in [a.name for a in target._schema.arguments]


def test_schedule_overlaps_next_launch_and_respects_buffer_reuse() -> None:
    kinds = ["compute", "launch", "wait", "compute", "launch", "wait", "compute"]
    order = EPScheduler(2).order([kinds] * 4)
    position = {step: i for i, step in enumerate(order)}
    for chunk in range(3):  # chunk c waits for its dispatch only after chunk c+1 launched its own
        assert position[(chunk + 1, 1)] < position[(chunk, 2)]
    for chunk in (2, 3):  # dispatch on set b only after the previous chunk on b launched its combine
        assert position[(chunk - 2, 4)] < position[(chunk, 1)]
    assert sorted(order) == [(c, i) for c in range(4) for i in range(len(kinds))]
    assert [c for c, i in EPScheduler(2).order([kinds] * 2, backward=True) if i == 1] == [1, 0]


def test_bfloat16_training_tracks_float32() -> None:
    def first_losses(dtype: str) -> list[float]:
        trainer = Trainer(TrainConfig(ep=2, chunking="eager", dtype=dtype))
        out = [trainer.step(s)["loss"] for s in range(2)]
        trainer.close()
        return out

    bf16, fp32 = first_losses("bfloat16"), first_losses("float32")
    assert bf16 != fp32  # really computed in bf16
    assert all(abs(a - b) / b < 2e-2 for a, b in zip(bf16, fp32))


def test_backward_on_a_thread_that_did_not_run_the_forward_finds_the_exchange() -> None:
    """On CUDA, autograd runs the backward of CUDA ops on its own device thread, where nothing is
    bound; CPU shows the same when backward is called from another thread. The exchange must travel
    with the autograd graph, and the gradients must be the ones the forward's thread computes."""
    events: list[dict] = []
    trainer = Trainer(TrainConfig(ep=1), event_sink=lambda rank, e: events.append(e))
    replica = trainer.replicas[0]
    inputs, labels = synthetic_batch(trainer.config, trainer.cfg.vocab_size, 1, 0)

    def grads_after(backward_elsewhere: bool) -> dict[str, torch.Tensor]:
        replica.optimizer.zero_grad(set_to_none=True)
        with bind(replica.exchange):
            loss = causal_lm_loss(replica.model(inputs), labels)
            if not backward_elsewhere:
                loss.backward()
        if backward_elsewhere:
            with ThreadPoolExecutor(1) as pool:
                pool.submit(loss.backward).result()  # raises here if the exchange is not found
        return {n: p.grad.clone() for n, p in replica.model.named_parameters() if p.grad is not None}

    elsewhere = grads_after(backward_elsewhere=True)
    assert any(e["phase"] == "bwd" and e["op"] == "launch" for e in events)
    here = grads_after(backward_elsewhere=False)
    assert elsewhere.keys() == here.keys() and all(torch.equal(elsewhere[n], here[n]) for n in here)
    trainer.close()
