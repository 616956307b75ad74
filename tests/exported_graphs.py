"""Hand-made records of chunked exchanges: graph.json contents and token-exchange events, as the
reference writes them, scheduled with or without overlap, for the graph and overlap checks' tests."""

from __future__ import annotations

from harness.subject.protocol import ArmFacts

MOE_LAYERS = (1, 2)
MOE_ROOT = "model.layers.{layer}.mlp"


def arm_facts(layers: list[int] | tuple[int, ...] | None = MOE_LAYERS, root: str = MOE_ROOT) -> ArmFacts:
    """An arm.json's facts as a reference arm of two chunks on two buffer sets writes them: its MoE
    layers and each one's chunk root (none known: ``layers`` None)."""
    if layers is None:
        return ArmFacts(chunks=2, num_buffer_sets=2)
    roots = tuple(root.format(layer=layer) for layer in layers)
    return ArmFacts(moe_layers=tuple(layers), chunks=2, num_buffer_sets=2, chunk_roots=roots)


# Each direction of a MoE layer exchanges twice per chunk, each a launch then its wait.
OPS = {"fwd": ("dispatch", "combine"), "bwd": ("dispatch_data", "combine_data")}
POOLS = {"dispatch": "dispatch", "combine": "combine", "dispatch_data": "dispatch", "combine_data": "combine"}
# Two chunks' items (launch, wait, launch, wait) as (visit position, item): the EP scheduler holds a
# chunk's k-th wait until the next chunk has issued its k-th launch; a serial one does not.
OVERLAPPED = ((0, 0), (1, 0), (0, 1), (0, 2), (1, 1), (1, 2), (0, 3), (1, 3))
SERIAL = ((0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3))


def _items(phase: str, schedule: tuple, backward_ascending: bool) -> list[tuple[int, str, str]]:
    """(chunk, op, role) of one region in schedule order; backward visits chunks C-1..0."""
    visit = [1, 0] if phase == "bwd" and not backward_ascending else [0, 1]
    return [
        (visit[position], OPS[phase][item // 2], "launch" if item % 2 == 0 else "wait") for position, item in schedule
    ]


def exported_graph(
    schedule: tuple = OVERLAPPED,
    *,
    backward_schedule: tuple | None = None,
    root: str = "model.layers.{layer}.mlp",
    backward_ascending: bool = False,
) -> dict:
    """graph.json of a traced arm with 2 chunks on 2 buffer sets, every region scheduled by ``schedule``."""
    nodes: list[dict] = []
    for phase in ("fwd", "bwd"):
        for layer in MOE_LAYERS:
            order = schedule if phase == "fwd" or backward_schedule is None else backward_schedule
            for chunk, op, role in _items(phase, order, backward_ascending):
                launch = f"{op}_l{layer}_c{chunk}"
                name = launch if role == "launch" else f"wait_{launch}"
                node = {
                    "order": 10 * len(nodes) + 7,  # compute nodes sit between the exchange ops
                    "name": name,
                    "op": op if role == "launch" else f"wait_{op}",
                    "role": role,
                    "pool": POOLS[op],
                    "buffer_set": chunk % 2,
                    "chunk": chunk,
                    "region": root.format(layer=layer),
                    "phase": phase,
                    "users": [f"wait_{launch}"] if role == "launch" else [f"unpermute_l{layer}_c{chunk}"],
                }
                if role == "wait":
                    node["consumes"] = launch
                nodes.append(node)
    return {"nodes": nodes}


def exchange_events(steps: int = 1, *, forward: tuple = OVERLAPPED, backward: tuple = SERIAL) -> list[dict]:
    """One logical rank's events of an eager chunked arm: a scheduled forward, autograd's backward."""
    events: list[dict] = []
    for step in range(1, steps + 1):
        for phase, schedule in (("fwd", forward), ("bwd", backward)):
            layers = MOE_LAYERS if phase == "fwd" else MOE_LAYERS[::-1]
            for layer in layers:
                for chunk, op, role in _items(phase, schedule, backward_ascending=False):
                    events.append(
                        {
                            "step": step,
                            "phase": phase,
                            "layer": layer,
                            "chunk": chunk,
                            "kind": POOLS[op],
                            "op": role,
                            "name": op,
                            "buffer_set": chunk % 2,
                            "seq": len(events),
                            "rows": 256,
                        }
                    )
    return events
