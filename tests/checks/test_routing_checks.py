"""The routing-counts rule on hand-made launch events: matching counts, mismatches, balance, absence."""

from __future__ import annotations

from pathlib import Path

from harness.checks.routing import check_routing_counts


def _launch(step: int, send: list[int], recv: list[int], layer: int = 1, phase: str = "fwd", seq: int = 0) -> dict:
    return {
        "step": step, "phase": phase, "layer": layer, "chunk": 0, "kind": "dispatch", "op": "launch",
        "name": "dispatch", "buffer_set": 0, "seq": seq, "rows": sum(recv), "send_counts": send, "recv_counts": recv,
    }  # fmt: skip


def _wait(step: int, seq: int) -> dict:
    return {**_launch(step, [], []), "op": "wait", "seq": seq}


def _learned() -> dict[int, list[dict]]:
    """Three ranks, two steps; rank i sends rank j (i + 1) * (j + 2) rows."""
    send = {i: [(i + 1) * (j + 2) for j in range(3)] for i in range(3)}
    return {
        r: [
            event
            for step in (1, 2)
            for event in (
                _launch(step, send[r], [send[i][r] for i in range(3)], seq=2 * step),
                _wait(step, 2 * step + 1),
            )
        ]
        for r in range(3)
    }


def test_learned_counts_that_pair_up_pass() -> None:
    result = check_routing_counts("arm: routing-counts", _learned())
    assert result.status == "pass", result.detail
    assert "2 exchanges on 3 logical ranks" in result.detail


def test_a_receive_count_that_does_not_match_the_send_fails_naming_both_ranks() -> None:
    events = _learned()
    events[2][2]["recv_counts"][0] += 1  # step 2: rank 2 believes rank 0 sent it one more row
    result = check_routing_counts("arm: routing-counts", events)
    assert result.status == "fail" and result.first_divergent_step == 2
    assert result.detail == (
        "step 2 fwd layer 1 chunk 0 dispatch: logical rank 0 sends 4 rows to logical rank 2, which receives 5 from it"
    )


def test_forced_balanced_counts_must_equal_the_known_value() -> None:
    balanced = {r: [_launch(1, [64, 64], [64, 64])] for r in range(2)}
    assert check_routing_counts("x", balanced, expected=64).status == "pass"
    result = check_routing_counts("x", balanced, expected=32)
    assert result.status == "fail" and "forced-balanced routing gives 32 each" in result.detail


def test_an_exchange_missing_on_one_rank_fails() -> None:
    events = _learned()
    events[1] = events[1][:2]
    result = check_routing_counts("x", events)
    assert result.status == "fail" and "step 2 fwd layer 1 chunk 0 dispatch: no such launch on logical rank 1" in (
        result.detail
    )


def test_a_launch_without_counts_fails() -> None:
    events = _learned()
    del events[0][0]["send_counts"]
    result = check_routing_counts("x", events)
    assert result.status == "fail" and "logical rank 0 recorded send_counts None" in result.detail


def test_no_launches_fail() -> None:
    assert check_routing_counts("x", {}).status == "fail"
    assert check_routing_counts("x", {0: [], 1: []}).status == "fail"
    assert check_routing_counts("x", {0: [_wait(1, 0)], 1: [_wait(1, 0)]}).status == "fail"


MISCOUNT = """
import os

from harness.reference.ep.exchange import TokenExchange

original = TokenExchange._emit


def miscounting_emit(self, op_name, op, buffer_set, rows, **counts):
    if counts and self.rank == 1 and self.step == 2:  # logical rank 1 claims one row more went to rank 0
        counts["send_counts"] = [counts["send_counts"][0] + 1, *counts["send_counts"][1:]]
    original(self, op_name, op, buffer_set, rows, **counts)


if os.environ.get("WORLD_SIZE") == "2":  # the procs arm only
    TokenExchange._emit = miscounting_emit
"""


def test_a_send_count_its_receiver_did_not_see_exits_1_naming_routing_counts(
    run_harness, plant, tmp_path: Path
) -> None:
    """Learned routing: the inproc arm's real counts pair up; the procs arm's planted one does not."""
    out = tmp_path / "run"
    run = run_harness(
        "run", "logical-ranks", "--steps", 2, "--set", 'routing="learned"', "--out", out, env=plant(MISCOUNT)
    )
    assert run.returncode == 1, run.stdout + run.stderr
    failed = {c["name"] for c in run.summary(out)["checks"] if c["status"] != "pass" and c["kind"] != "golden"}
    assert failed == {"procs: routing-counts"}, failed
    check = run.check(out, "procs: routing-counts")
    assert check["first_divergent_step"] == 2
    assert check["detail"].startswith("step 2 fwd layer 1 chunk 0 dispatch: logical rank 1 sends ")
    assert "rows to logical rank 0, which receives " in check["detail"]
    assert "each" not in run.check(out, "inproc: routing-counts")["detail"]  # learned: no fixed count
