"""harness submit and collect against a real one-node Slurm (slurm/local-cluster.sh), no mocks.

The session fixture starts the cluster; the tests skip only where it cannot be started (not
root, or no Slurm and no apt to install it), and say so. Each run has its own run directory, so
its submitit folder (RUN_DIR/slurm) is fresh: job ids restart at 1 with a fresh cluster.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from harness.launchers.slurm.jobs import RESULT_FILE, SlurmJob, read_results
from harness.launchers.slurm.profile import SlurmProfile, executor_parameters, job_shape
from harness.launchers.slurm.task import rendezvous_env, rendezvous_port, run_task
from harness.manifest import ManifestError
from harness.plan import LaunchGroup
from harness.suites import SuiteError

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "slurm" / "local-cluster.sh"
# Every job of a test: a small run, so the file stays quick on two cores.
FAST = ("--steps", 3, "--golden", "off")
RAISE_AT_STEP_2_ON_RANK_1 = ("--set", "debug.fail_step=2", "--set", "debug.fail_rank=1")
# squeue states (%T) of a job not yet ended.
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING"}
# What SLURM_* submitit reads inside a job: task 1 of job 42, on the second of two nodes.
TASK_1_OF_JOB_42 = {
    "SUBMITIT_EXECUTOR": "slurm",
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
}


class PlantedPickle:
    """A result pickle that, once loaded, creates ``marker``: what anyone who can write a run directory
    on a shared filesystem could leave there."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """The one-node cluster, started once per session (or found running); left running for other
    sessions under pytest-xdist, stopped at the end otherwise, if this session started it."""
    if os.geteuid() != 0:
        pytest.skip("a real Slurm needs root (slurm/local-cluster.sh installs packages and starts daemons)")
    installed = all(shutil.which(cmd) for cmd in ("slurmctld", "slurmd", "munged"))
    if not installed and shutil.which("apt-get") is None:
        pytest.skip("no Slurm installed and no apt-get to install slurm-wlm and munge")
    was_up = subprocess.run([CLUSTER, "status"], capture_output=True).returncode == 0
    up = subprocess.run([CLUSTER, "up"], capture_output=True, text=True, timeout=300)
    if up.returncode != 0:
        if not installed:
            pytest.skip(f"cannot install Slurm from Debian packages: {up.stderr.strip()}")
        pytest.fail(f"slurm/local-cluster.sh up failed: {up.stdout}{up.stderr}")
    yield
    if not was_up and "PYTEST_XDIST_WORKER" not in os.environ:
        subprocess.run([CLUSTER, "down"], capture_output=True, timeout=60)


def metrics(run_dir: Path, arm: str) -> list[tuple[float, float]]:
    lines = (run_dir / "arms" / arm / "metrics.jsonl").read_text().splitlines()
    return [(json.loads(line)["loss"], json.loads(line)["grad_norm"]) for line in lines]


def jobs_of(run_dir: Path, wait_s: float = 60) -> list[dict]:
    """The jobs a run queued, once its slurm/jobs.json is written."""
    path = run_dir / "slurm" / "jobs.json"
    give_up = time.monotonic() + wait_s
    while not path.is_file():
        assert time.monotonic() < give_up, f"no {path}"
        time.sleep(0.2)
    return json.loads(path.read_text())["jobs"]


def wait_until_ended(job_ids: list[str], wait_s: float = 120) -> None:
    give_up = time.monotonic() + wait_s
    query = ["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", "%T"]
    while set(subprocess.run(query, capture_output=True, text=True).stdout.split()) & ACTIVE_STATES:
        assert time.monotonic() < give_up, f"jobs {job_ids} did not end"
        time.sleep(0.2)


def wait_until_running(job_id: str, wait_s: float = 60) -> None:
    give_up = time.monotonic() + wait_s
    while subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.strip() != (
        "RUNNING"
    ):
        assert time.monotonic() < give_up, f"job {job_id} did not start"
        time.sleep(0.2)


def write_profile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "profile.toml"
    path.write_text(text)
    return path


@pytest.mark.usefixtures("slurm_cluster")
def test_submit_parity_matches_a_local_run_bit_for_bit(run_harness, start_harness, tmp_path: Path) -> None:
    local_dir, slurm_dir = tmp_path / "local", tmp_path / "slurm"
    local = start_harness("run", "parity", "--ranks", 2, *FAST, "--out", local_dir)
    submitted = run_harness("submit", "parity", "--ranks", 2, *FAST, "--profile", "local", "--out", slurm_dir)
    local_out, local_err = local.communicate(timeout=240)
    assert local.returncode == 0, local_out + local_err
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert "Slurm job" in submitted.stdout and "(1 node x 2 tasks, profile local)" in submitted.stdout
    summary = submitted.summary(slurm_dir)
    assert summary["verdict"] == "pass" and summary["launches"][0]["slurm_job"]["id"]
    for arm in ("eager", "eager-traced", "graph"):
        assert metrics(slurm_dir, arm) == metrics(local_dir, arm), arm  # floats read back exactly: bit for bit
    assert (slurm_dir / "logs" / "rank1.log").is_file()  # the rank logs land where a local run's do
    report = run_harness("report", slurm_dir)
    assert report.returncode == 0 and (slurm_dir / "report.html").is_file(), report.stderr


@pytest.mark.usefixtures("slurm_cluster")
def test_scancel_of_a_running_job_exits_3_within_30_s(start_harness, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = start_harness(
        "submit", "logical-ranks", "--steps", 500, "--golden", "off", "--profile", "local", "--out", out
    )
    job = jobs_of(out)[0]["job_id"]
    wait_until_running(job)
    subprocess.run(["scancel", job], check=True)
    cancelled = time.monotonic()
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 3, stdout + stderr
    assert time.monotonic() - cancelled < 30
    assert f"Slurm job {job} of group 'procs' was cancelled" in stderr
    launch = json.loads((out / "summary.json").read_text())["launches"][0]
    assert launch["slurm_job"]["state"] == "CANCELLED" and launch["slurm_job"]["id"] == job


@pytest.mark.usefixtures("slurm_cluster")
def test_job_over_its_time_limit_exits_3(run_harness, tmp_path: Path) -> None:
    """Slurm's limit is whole minutes: the job hangs at step 2 and Slurm ends it after one."""
    out = tmp_path / "run"
    hang = ("--set", "debug.fail_step=2", "--set", "debug.fail_mode=hang")
    run = run_harness(
        "submit", "logical-ranks", *FAST, *hang, "--profile", "local", "--time", 1, "--out", out, timeout=200
    )
    assert run.returncode == 3, run.stdout + run.stderr
    assert "hit its Slurm time limit" in run.stderr and "DUE TO TIME LIMIT" in run.stderr
    assert json.loads((out / "summary.json").read_text())["launches"][0]["slurm_job"]["state"] == "TIMEOUT"


@pytest.mark.usefixtures("slurm_cluster")
@pytest.mark.parametrize(
    ("profile", "flags", "message"),
    [
        ('cpus_per_task = "four"\n', (), 'profile.toml: cpus_per_task: expected int >= 1, got "four"'),
        ('[env]\n"NCCL-DEBUG" = "INFO"\n', (), "profile.toml: env.NCCL-DEBUG: expected an environment variable name"),
        ("setup = 'module load cuda'\n", (), 'profile.toml: setup: expected a list of shell lines, got "module'),
        ("partiton = 'debug'\n", (), "profile.toml: partiton: unknown key (allowed: description, partition"),
        ("", ("--time", "five"), '--time: expected int >= 1, got "five"'),
        ("", ("--nodes", 4), "--nodes 4: group 'eager+eager-traced+graph' has 2 ranks, not a multiple of 4"),
    ],
)
def test_bad_profile_exits_2_with_nothing_submitted(harness_main, tmp_path: Path, profile, flags, message) -> None:
    out = tmp_path / "run"
    run = harness_main("submit", "parity", "--profile", write_profile(tmp_path, profile), *flags, "--out", out)
    assert run.returncode == 2, run.stdout + run.stderr
    assert message in run.stderr
    assert not out.exists()
    # No job of this run: its jobs would write their output under `out`. (Other tests submit meanwhile.)
    queued = subprocess.run(["squeue", "-h", "-t", "all", "-O", "JobID:12,StdOut:4096"], capture_output=True, text=True)
    assert queued.returncode == 0 and str(out) not in queued.stdout, queued.stdout


@pytest.mark.usefixtures("slurm_cluster")
def test_a_rank_that_raises_in_a_job_is_judged_as_locally_also_after_no_wait(run_harness, tmp_path: Path) -> None:
    """As a local run: the injected raise is the harness's own code, so infrastructure (exit 3), with
    its traceback; judged by ``collect`` after ``--no-wait``, from the tasks' JSON results alone:
    every result pickle replaced by a payload, none is loaded. Also: a profile's values reach the job
    script quoted, never run."""
    out, planted, unpickled = tmp_path / "run", tmp_path / "injected", tmp_path / "unpickled"
    profile = write_profile(tmp_path, f'partition = "debug"\n[env]\nHARNESS_PROBE = "$(touch {planted})"\n')
    submitted = run_harness(
        "submit", "logical-ranks", *FAST, "--profile", profile, "--out", out, "--no-wait", *RAISE_AT_STEP_2_ON_RANK_1
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert f"run dir: {out}" in submitted.stdout and "Slurm job" in submitted.stdout
    assert not (out / "summary.json").exists()
    procs, inproc = (job["job_id"] for job in jobs_of(out))
    subprocess.run(["scancel", inproc], check=True)  # not waited for: the judging stops at the failed group
    wait_until_ended([procs, inproc])
    pickles = list((out / "slurm").glob("*_result.pkl"))
    assert pickles, f"{out / 'slurm'}: expected submitit's result pickles, got {os.listdir(out / 'slurm')}"
    for path in pickles:
        path.write_bytes(pickle.dumps(PlantedPickle(unpickled)))
    collected = run_harness("collect", out)
    assert collected.returncode == 3, collected.stdout + collected.stderr
    assert "rank 1 of group 'procs' failed first" in collected.stderr
    assert "raised outside the system under test" in collected.stderr
    assert "Traceback (most recent call last)" in collected.stderr
    assert "RuntimeError: injected failure" in collected.stderr
    summary = collected.summary(out)
    assert summary["verdict"] == "error" and summary["arms"]["procs"]["steps_completed"] == 1
    assert summary["launches"][0]["root_cause"]["rank"] == 1
    assert "RuntimeError: injected failure" in (out / "logs" / "procs" / "rank1.log").read_text()
    assert len(summary["launches"]) == 1  # the next group's job (inproc) never ran: it was cancelled
    assert (out / "junit.xml").is_file() and (out / "report.html").is_file()
    script = next((out / "slurm").glob("*_submission.sh")).read_text()
    assert f"export HARNESS_PROBE='$(touch {planted})'" in script
    assert not planted.exists()
    assert not unpickled.exists(), "harness collect: expected no pickle loaded, got the planted payload run"


def test_a_task_that_raises_itself_leaves_its_traceback_as_json(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A task that raises outside its worker (here: its run directory has no manifest) writes its
    traceback into its JSON result, which the watch reads as that task's failure."""
    for key, value in TASK_1_OF_JOB_42.items():
        monkeypatch.setenv(key, value)
    for key in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(key, "stale")  # restored after the test; the task exports them
    monkeypatch.setenv("MASTER_PORT", "29511")
    (tmp_path / "slurm").mkdir()
    with pytest.raises(ManifestError, match="manifest.json: not readable"):
        run_task(str(tmp_path), "procs", {})
    results = read_results(tmp_path, SlurmJob("procs", "42", nodes=2, tasks_per_node=1))
    assert set(results) == {1} and results[1]["exitcode"] == 1, f"read_results: expected task 1 failed, got {results}"
    assert "ManifestError" in results[1]["traceback"] and "manifest.json" in results[1]["traceback"]


@pytest.mark.parametrize(
    "text",
    ["", '{"rank": 0, "exitcode": ', '{"rank": 0}', '{"rank": 1, "exitcode": 0}', '{"rank": 0, "exitcode": "0"}', "[]"],
)
def test_a_task_result_that_does_not_read_as_one_counts_as_missing(tmp_path: Path, text: str) -> None:
    """A torn, empty or malformed result (a task killed mid-write, a file someone else wrote) is the
    task's result missing, which the watch handles (a lost job), never a crash."""
    job = SlurmJob("procs", "7", nodes=1, tasks_per_node=2)
    (tmp_path / "slurm").mkdir()
    job.file(tmp_path, RESULT_FILE, 0).write_text(text)
    job.file(tmp_path, RESULT_FILE, 1).write_text(json.dumps({"rank": 1, "exitcode": 0, "died_at": 1.5}))
    assert set(read_results(tmp_path, job)) == {1}, f"read_results: expected task 0 missing for {text!r}"


def test_nodes_spread_the_ranks_and_one_rendezvous_spans_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """What one machine can check of the multi-node path: the job's shape, and the rendezvous
    environment a task on the second node of two builds from Slurm's."""
    group = LaunchGroup("procs", 2, ("procs",), "logs")
    assert job_shape(group, 2) == 1 and job_shape(group, 1) == 2
    with pytest.raises(SuiteError, match="has 2 ranks, not a multiple of 3"):
        job_shape(group, 3)
    parameters = executor_parameters(SlurmProfile("p", gpus_per_node=8), "n", 2, 1, after="41")
    assert (parameters["nodes"], parameters["tasks_per_node"], parameters["gpus_per_node"]) == (2, 1, 8)
    assert parameters["slurm_additional_parameters"]["dependency"] == "afterany:41"
    for key, value in TASK_1_OF_JOB_42.items():
        monkeypatch.setenv(key, value)
    for key in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(key, "stale")  # restored after the test; the export overwrites them
    monkeypatch.setenv("MASTER_PORT", "29511")  # a port the submitting environment chose is kept
    env = rendezvous_env()
    assert env["MASTER_ADDR"] == "gpu07"  # the first node: every task meets there
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("1", "2", "0", "1")
    assert env["MASTER_PORT"] == "29511"
    monkeypatch.delenv("MASTER_PORT")
    assert rendezvous_env()["MASTER_PORT"] == str(rendezvous_port("42"))  # the same on every task of job 42


def test_rendezvous_ports_stay_below_the_ephemeral_range() -> None:
    """Outgoing connections take their local ports from the ephemeral range; a job's MASTER_PORT
    drawn there can be held by one, and rank 0's store then fails with EADDRINUSE."""
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [rendezvous_port(str(job)) for job in range(1, 2001)]
    assert all(20000 <= port < first_ephemeral for port in ports)
    assert len(set(ports)) > 1000  # spread, so that concurrent jobs rarely share one
