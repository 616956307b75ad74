"""Launch groups as Slurm jobs through submitit, the sibling of the elastic-agent launcher (local.py).

Each launch group of a run becomes one job of ``nodes`` x ``ranks / nodes`` tasks, and each task
runs the same rank process (harness/rank/) as a local launch, into the same run directory, which must
therefore be on a filesystem every node shares. One file per job:

- ``profile.py``: cluster profiles (``slurm/<name>.toml``) and submitit's parameters for a job;
- ``submit.py``: queueing the chained jobs, and cancelling them;
- ``task.py``: inside a job, one task: the rendezvous environment, the worker, its result;
- ``jobs.py``: the job files in ``RUN_DIR/slurm/``: ``jobs.json`` and the tasks' JSON results;
- ``watch.py``: ``JobWatch``, the GroupLauncher that waits for each job and says how it ended.

``harness submit`` and ``harness collect`` themselves, which prepare and judge the run as
``harness run`` does, are harness/slurm_run.py.
"""
