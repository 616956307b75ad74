"""One rank of a launch group: ``python -m harness.rank RUN_DIR GROUP``, started by a launcher (harness/launchers/).

The rank runs each arm of its group in turn, built by the suite's subject (harness/subject/) from a
fresh seed, and writes what it records (``harness/rundir.py`` names every file); a throughput run's
group it times instead. One module per job:

- ``__main__.py``: the entry: the manifest, the subject, the process group, the group's arms or
  blocks, and a fast exit, at the end or on an error;
- ``process.py``: the process: killed with the harness, one log in order, stacks dumped on SIGUSR1,
  its GPU and its process group;
- ``errors.py``: the error file, written into room claimed at start-up, so a full disk still gets the
  rank's own error reported; the launchers free the room;
- ``train.py``: one arm built, trained and recorded: ``metrics.jsonl``, ``arm.json``, ``graph.json``,
  the final weights' hashes; a resumed arm's two launches; an op-recording re-run's op files;
- ``recorder.py``: the Recorder a built arm records through: every record family checked, then
  streamed to its file;
- ``throughput.py``: a throughput run's block positions timed into ``throughput.jsonl``;
- ``faults.py``: the [debug] table's planted failures, which prove the failure paths.

Importing the package imports none of them: the launchers import ``errors`` and ``process`` alone.
"""
