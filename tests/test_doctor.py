"""``harness doctor``'s real step: one step of the reference, twice, through the whole harness."""

from __future__ import annotations

from harness.doctor import step_preflight


def test_doctor_step_trains_one_step_twice_on_the_ranks_a_run_would_use(run_harness) -> None:
    run = run_harness("doctor", "--step", "--ranks", 2)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ok: training step: one step of the reference on 2 gloo ranks (cpu), twice: bitwise equal" in (
        run.stdout.splitlines()
    )


def test_a_step_that_fails_is_missing_with_the_rank_and_what_it_did(run_harness) -> None:
    item = step_preflight("cpu", 2, overrides=("debug.fail_step=1", "debug.fail_rank=1"))
    assert not item.ok
    assert item.detail.startswith("one step of the reference on 2 gloo ranks (cpu), twice: exit 3, ")
    assert "rank 1 failed first" in item.detail and "injected failure" in item.detail
