"""Checkpoints of a reference :class:`~harness.reference.train.Trainer`, through torch.distributed.checkpoint.

A training run that stops and resumes must go on exactly as if it had not stopped. A checkpoint
therefore holds every logical rank's whole training state, keyed by logical rank, so that it loads
into any process layout of the same EP degree (EP=2 on 2 processes saves, EP=2 on 1 process loads,
and the reverse: each process writes and reads its own logical ranks' keys):

- ``rank<r>.model.<name>``: every parameter and buffer of logical rank ``r``'s model, its expert
  shard included (the correction biases are buffers; a PEC arm's table shard is a parameter);
- ``rank<r>.optim.<name>.<step|exp_avg|exp_avg_sq>``: its AdamW state, per parameter by name;
- ``rank<r>.in_flight.<name>``: the work a pipelined trainer holds between steps
  (``Trainer.in_flight_state``; none for plain training, which finishes each batch in its step):

  - a versioned arm (:class:`~harness.reference.pipeline.VersionedTrainer`): ``trainer`` (tick,
    update and record counters), ``version`` (generation, revision), ``counters`` (forward
    sequence, forwards, replays), ``logprobs_now.<batch>`` (the correction's current logprobs),
    per pending forward ``forward.<seq>.<batch|version|inputs|labels|loss|logprobs|rng>``, and each
    version's snapshot once, ``snapshot.<generation>.<revision>.<name>``, however many pending
    forwards share it. A graph is not a tensor: a restored forward replays on its snapshot with its
    RNG state, under every retention, and the replay checks the saved loss bit for bit
    (:meth:`~harness.reference.versioned.VersionedModel.load_state`);
  - a PEC arm (:class:`~harness.reference.pec.PECTrainer`): ``trainer`` (batches done), ``events``
    (the event counter), ``rowwise_state`` (the row-wise optimizer's) and each gradient part backward
    handed over and nobody applied yet, ``gradient.<batch>.<OL|NOL>.<ids|grads>`` (pipelined,
    between batches: the last batch's NOL part);

  their count and shapes vary, so a load sizes them from the checkpoint's index;
- ``rng.torch``: the CPU generator's state (process rank 0's), though the reference draws nothing
  from it while training: its batches are functions of (seed, step, rank), so the data position is
  the step, which the manifest records.

Layout under a checkpoint folder::

    step-<k>/                   a complete checkpoint, after the arm's step k
        .metadata               torch.distributed.checkpoint's index of every tensor
        __<p>_0.distcp          process p's tensors
        harness.json            the step, the arm's config, the EP degree, the key count and each
                                other file's tag
    step-<k>.partial/           a save in progress: never loaded, removed by the next save

**Atomic.** Every process writes into ``step-<k>.partial``; once all have (a barrier), process rank
0 signs every file there, writes ``harness.json`` and renames the folder to ``step-<k>``. A save
killed midway leaves a ``.partial`` folder and the previous checkpoint as it was.

**Trusted.** Only tensors are stored, and ``harness.json`` is JSON; but torch.distributed.checkpoint
unpickles ``.metadata`` (any pickle, which runs code) and every tensor of a ``.distcp`` shard (through
torch's restricted ``weights_only`` unpickler). So nothing is read that is not proven this user's own
(:mod:`harness.trust`):

- folders 0700 and files 0600 whatever the umask: the save makes them so;
- at save, process rank 0 reads each file back once and records its HMAC-SHA256 tag under the user's
  key (:func:`harness.trust.user_key`), over ``step-<k>/<file>`` and its bytes, in ``harness.json``;
- at load, every folder from ``/`` down to ``step-<k>`` must be the user's or root's and writable by
  nobody else unless sticky (OpenSSH's StrictModes, :func:`harness.trust.check_path`): a folder others
  may write lets them swap the checkpoint, or a folder above it, for their own;
- and since a path checked is not the file read (a swap between the two, ``renameat2``), each file
  is read once through a descriptor that follows no link, its tag checked on those bytes, and only
  those bytes go to torch.distributed.checkpoint (:class:`_SignedReader`): the index is unpickled
  from them, the tensors loaded from them.

A checkpoint that fails any of these is refused, naming the file and why.

**A partial checkpoint never loads.** :func:`load` checks, before reading a byte of tensor data,
``harness.json`` against the arm's config, every shard file the index reads from (there, and as
long as the index reads), and the saved keys against the trainer's; then it reads through
torch.distributed.checkpoint, each shard checked against its tag as it is read. Each is a
:class:`CheckpointError` naming the file and what is wrong. An in-flight tensor the trainer
needs and the index lacks is refused the same way, naming its key.

**Planted faults** (``TrainConfig.checkpoint_fault``, for the harness's ``resume`` suite): the
AdamW state left out (:func:`state`), the data position lost (:func:`load`), a versioned arm's
oldest pending forward left out, a PEC arm's pending NOL part left out (their trainers'
``in_flight_state``). Each checkpoint still loads; only the numbers after it show the loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from harness import trust
from harness.reference.train import Trainer
from harness.trust import TrustError

FORMAT = 2  # 2: harness.json holds each file's tag
MANIFEST = "harness.json"
INDEX = ".metadata"  # torch.distributed.checkpoint's index, a pickle
TAG_HEX = re.compile(r"[0-9a-f]{64}")
# A test's seam: a folder in which each loading process, between the path check and the first read,
# makes ``checked`` and waits for ``go`` (up to RACE_WAIT_S), so that a test can swap folders there.
RACE_ENV = "HARNESS_TEST_CHECKPOINT_RACE"
RACE_WAIT_S = 120
PARTIAL = ".partial"
ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")
IN_FLIGHT = "in_flight"  # the namespace of a pipelined trainer's work between steps, per logical rank


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded: the message names the file and what is wrong."""


def state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This process's keys: its logical ranks' models and AdamW states, and (process rank 0) the RNG.
    The tensors are the live ones: loading into them restores the trainer in place. The planted
    fault ``optimizer-not-saved`` leaves the AdamW states out (of the save and of the load)."""
    tensors: dict[str, torch.Tensor] = {}
    for rank, replica in trainer.replicas.items():
        for name, tensor in replica.model.state_dict(keep_vars=True).items():
            tensors[f"rank{rank}.model.{name}"] = tensor.data
        for name, param in replica.model.named_parameters():
            if not param.requires_grad or trainer.config.checkpoint_fault == "optimizer-not-saved":
                continue
            adam = replica.optimizer.state[param]
            if not adam:  # before the first step: AdamW creates its state lazily
                adam.update(
                    step=torch.zeros((), dtype=torch.float32),
                    exp_avg=torch.zeros_like(param, memory_format=torch.preserve_format),
                    exp_avg_sq=torch.zeros_like(param, memory_format=torch.preserve_format),
                )
            for key in ADAM_STATE:
                tensors[f"rank{rank}.optim.{name}.{key}"] = adam[key]
    if trainer.group.process_rank == 0:
        tensors["rng.torch"] = torch.get_rng_state()
    return tensors


def in_flight(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This process's ``rank<r>.in_flight.<name>`` keys: the work a pipelined trainer holds between
    steps (``Trainer.in_flight_state``), whose count and shapes vary: a load sizes them from the
    checkpoint's index."""
    return {
        f"rank{rank}.{IN_FLIGHT}.{name}": tensor
        for rank, held in trainer.in_flight_state().items()
        for name, tensor in held.items()
    }


class _Held(dict):
    """One logical rank's in-flight tensors as loaded: a name the checkpoint lacks is refused, naming it."""

    def __init__(self, index: Path, prefix: str) -> None:
        super().__init__()
        self.index, self.prefix = index, prefix

    def __missing__(self, name: str) -> torch.Tensor:
        raise CheckpointError(f"{self.index}: no tensor {self.prefix}{name}")


def _fingerprint(trainer: Trainer) -> dict:
    """What a checkpoint must match to load: the arm's config but its process layout."""
    return dataclasses.asdict(trainer.config)


def save(trainer: Trainer, step: int, folder: Path) -> Path:
    """Save the trainer after update ``step`` into ``folder/step-<step>``, atomically; every process
    calls it. Returns the checkpoint's path."""
    final, partial = folder / f"step-{step}", folder / f"step-{step}{PARTIAL}"
    first = trainer.group.process_rank == 0
    if first:
        shutil.rmtree(partial, ignore_errors=True)  # a save killed earlier
        trust.make_private_folders(partial)
    _barrier(trainer)
    tensors = state(trainer) | in_flight(trainer)
    with _one_process_quietly():
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(partial), no_dist=not trainer.group.distributed)
    keys = _count(trainer, len(tensors) - (1 if first else 0))
    _barrier(trainer)
    if first:
        manifest = {"format": FORMAT, "step": step, "ep": trainer.config.ep, "keys": keys + 1}
        manifest["config"] = _fingerprint(trainer)
        manifest["tags"] = _sign(partial, step)
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        (partial / MANIFEST).chmod(0o600)
        _fsync_dir(partial)
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_dir(folder)
    _barrier(trainer)
    return final


def load(trainer: Trainer, folder: Path, step: int) -> int:
    """Restore the trainer in place from ``folder``'s checkpoint of update ``step``; every process
    calls it. Returns the data position the checkpoint records: training resumes at the batch after
    it. The planted fault ``data-position-lost`` returns 0 instead (the batches start over)."""
    checkpoint = folder / f"step-{step}"
    if not checkpoint.is_dir():
        found = sorted(p.name for p in folder.glob("step-*")) if folder.is_dir() else []
        raise CheckpointError(f"{checkpoint}: no such checkpoint (found: {', '.join(found) or 'none'})")
    try:
        trust.check_path(checkpoint)
    except TrustError as e:
        raise CheckpointError(f"{e}: another user could swap in a checkpoint of theirs: not loaded") from None
    _race_window()
    manifest = _manifest(checkpoint)
    expected, saved = _fingerprint(trainer), manifest["config"]
    differing = sorted(k for k in expected.keys() | saved.keys() if expected.get(k) != saved.get(k))
    if differing:
        field = differing[0]
        raise CheckpointError(
            f"{checkpoint / MANIFEST}: config.{field}: saved {saved.get(field)!r}, this arm has {expected.get(field)!r}"
        )
    tensors = state(trainer)
    if trainer.group.process_rank != 0:
        tensors["rng.torch"] = torch.get_rng_state()  # every process takes process rank 0's stream
    reader = _SignedReader(checkpoint, step, manifest["tags"])
    index = reader.read_metadata()
    _whole_shards(checkpoint, index.storage_data.values())
    stored = index.state_dict_metadata
    missing = sorted(set(tensors) - set(stored))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"{checkpoint / INDEX}: no tensor {missing[0]}{more}")
    held = {rank: _Held(checkpoint / INDEX, f"rank{rank}.{IN_FLIGHT}.") for rank in trainer.replicas}
    for key, meta in stored.items():  # sized from the index: their count and shapes vary
        for ours in held.values():
            if key.startswith(ours.prefix):
                ours[key.removeprefix(ours.prefix)] = tensors[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        with _one_process_quietly():
            dcp.load(tensors, storage_reader=reader, no_dist=not trainer.group.distributed)
    except CheckpointException as e:  # every process's failures, the same on every process
        failure = next(exc for exc, _ in e.failures.values())
        if isinstance(failure, CheckpointError):  # a shard refused or unreadable (_SignedFiles)
            raise CheckpointError(str(failure)) from None
        raise CheckpointError(f"{checkpoint}: cannot load its tensors ({type(failure).__name__})") from None
    trainer.load_in_flight(held)
    torch.set_rng_state(tensors["rng.torch"])
    return 0 if trainer.config.checkpoint_fault == "data-position-lost" else manifest["step"]


def _signed_name(step: int, relative: str) -> str:
    """What a file's tag covers beside its bytes: a file signed for another step or name is refused."""
    return f"step-{step}/{relative}"


def _sign(partial: Path, step: int) -> dict[str, str]:
    """Each file the processes wrote into ``partial``, made 0600 whatever the umask, and its tag (hex)
    under the user's key over the bytes read back once through one descriptor."""
    key = _user_key("signed")
    tags = {}
    for path in sorted(partial.iterdir()):
        path.chmod(0o600)
        with trust.open_own_file(path) as file:
            tags[path.name] = trust.tag(key, _signed_name(step, path.name), file.read()).hex()
    return tags


class _SignedFiles(FileSystem):
    """A checkpoint's files as torch.distributed.checkpoint reads them: each read once, through a
    descriptor that follows no link, and handed over from memory once its tag is checked."""

    def __init__(self, checkpoint: Path, step: int, tags: dict[str, str]) -> None:
        super().__init__()
        self.checkpoint, self.step, self.tags = checkpoint, step, tags
        self.key = _user_key("checked")

    def verified(self, path: Path) -> bytes:
        """The bytes of ``path`` (in the checkpoint), once they are found to be what the save signed."""
        relative = path.relative_to(self.checkpoint).as_posix()
        if relative not in self.tags:
            raise CheckpointError(f"{path}: not signed in {MANIFEST}: not loaded")
        expected = bytes.fromhex(self.tags[relative])
        try:
            return trust.verified_payload(path, self.key, _signed_name(self.step, relative), expected)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing: not a complete checkpoint") from None
        except TrustError as e:
            raise CheckpointError(f"{e}: not loaded") from None
        except OSError as e:
            raise CheckpointError(f"{path}: unreadable ({e.strerror})") from None

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.BytesIO]:
        """A shard to read tensors from: its verified bytes. Whatever fails while they are read is
        refused naming the shard (torch's own words would advise loading it unchecked)."""
        path = Path(path)
        payload = self.verified(path)
        try:
            yield io.BytesIO(payload)
        except Exception as e:
            raise CheckpointError(f"{path}: signed, yet not tensors this build reads ({type(e).__name__})") from None


class _SignedReader(dcp.FileSystemReader):
    """torch.distributed.checkpoint's reader of a checkpoint folder, reading only verified bytes: the
    index is read and checked once, here, and unpickled from those bytes however often torch asks."""

    def __init__(self, checkpoint: Path, step: int, tags: dict[str, str]) -> None:
        super().__init__(checkpoint)
        self.fs = _SignedFiles(checkpoint, step, tags)
        self.index = self.fs.verified(checkpoint / INDEX)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The index as torch's own reader returns it, unpickled from the verified bytes."""
        metadata = pickle.loads(self.index)
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _user_key(use: str) -> bytes:
    """The user's key (:func:`harness.trust.user_key`); one that is not the user's secret is a CheckpointError."""
    try:
        return trust.user_key()
    except TrustError as e:
        raise CheckpointError(f"{e}: no checkpoint can be {use} with it") from None


def _race_window() -> None:
    """The test seam RACE_ENV names: nothing unless a test sets it."""
    folder = os.environ.get(RACE_ENV)
    if not folder:
        return
    (Path(folder) / "checked").touch()
    deadline = time.monotonic() + RACE_WAIT_S
    while not (Path(folder) / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _whole_shards(checkpoint: Path, extents: Iterable[Any]) -> None:
    """Every shard file the index reads from, there and as long as the index reads: checked on every
    process before any reads, so a missing or short shard is refused alike everywhere, naming it
    (torch would say only that some read failed). ``extents``: the index's storage records, each a
    shard's ``relative_path`` and the ``offset`` and ``length`` of one tensor's bytes in it."""
    needed: dict[str, int] = {}
    for extent in extents:
        needed[extent.relative_path] = max(needed.get(extent.relative_path, 0), extent.offset + extent.length)
    for name, size in sorted(needed.items()):
        shard = checkpoint / name
        if not shard.is_file():
            raise CheckpointError(f"{shard}: missing: the index reads {size} bytes of tensors from it")
        if shard.stat().st_size < size:
            raise CheckpointError(f"{shard}: truncated: {shard.stat().st_size} bytes, the index reads {size}")


def _manifest(checkpoint: Path) -> dict:
    path = checkpoint / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing: the save did not finish") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable: {e}") from None
    for key, kind in (("format", int), ("step", int), ("config", dict)):
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            raise CheckpointError(f"{path}: {key}: expected {kind.__name__}, got {manifest.get(key)!r}")
    if manifest["format"] != FORMAT:
        raise CheckpointError(f"{path}: format: {manifest['format']}, this harness reads {FORMAT}")
    tags = manifest.get("tags")
    if not isinstance(tags, dict) or not all(isinstance(t, str) and TAG_HEX.fullmatch(t) for t in tags.values()):
        raise CheckpointError(f"{path}: tags: expected each file's tag, 64 hex digits, got {tags!r:.80}")
    return manifest


def _count(trainer: Trainer, local: int) -> int:
    """The tensor keys of all processes, for the manifest."""
    if not trainer.group.distributed:
        return local
    total = torch.tensor(local)
    dist.all_reduce(total)
    return int(total)


@contextlib.contextmanager
def _one_process_quietly() -> Iterator[None]:
    """Without a process group (EP in one process) torch warns that it saves in one process: as meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _barrier(trainer: Trainer) -> None:
    if trainer.group.distributed:
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
