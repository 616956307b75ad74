"""Where a run's numbers come from: versions, the device class, the CPU kernel pin, the env key.

A golden is owed only by the environment that recorded it. On CPUs, torch's kernels (ATen's
vectorised loops, MKL's BLAS, oneDNN) dispatch on the widest vector ISA the machine has, so the
same run differs in the 7th digit between an AVX-512 and an AVX2-only x86-64 machine. The harness
therefore pins the ranks' kernels to AVX2 by default: every x86-64 server CPU of the last decade
has it. MKL promises the pinned code path's results only across CPUs of one vendor (its
conditional numerical reproducibility is for Intel CPUs; on others it takes other paths), and
measured so: an Intel Xeon under the pin parts from an AMD EPYC's golden at step 2 (grad norm,
1.4e-6 relative). So the device class names the vendor, and a golden recorded under the pin on
one machine checks bitwise on another of the same vendor, and at the cross-environment tier on
another vendor's. ``--cpu-isa native`` opts out for native speed; its goldens are keyed by the
ISA torch picks.

Device classes: ``cpu-pinned-avx2-<vendor>`` (the default on x86-64 with AVX2; vendor ``intel``,
``amd`` or what /proc/cpuinfo names), ``cpu-native-<isa>-<vendor>`` (``--cpu-isa native``, or a CPU
the pin cannot apply to), ``cuda-<gpu model>`` (``cuda-h200``).
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import harness
from harness.shipped import SOURCE_ROOT, in_checkout

CPU_ISAS = ("avx2", "native")
# What the AVX2 pin exports to every rank before torch loads there.
AVX2_PIN = {
    "ATEN_CPU_CAPABILITY": "avx2",  # ATen's vectorised CPU kernels
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL's BLAS, which runs torch's float32 matmuls on x86
    "MKL_CBWR": "AVX2",  # MKL's conditional numerical reproducibility: one code path on any AVX2 CPU
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN primitives
}


@dataclass(frozen=True)
class CpuPin:
    """The kernel ISA a CPU run's ranks use, and the environment that makes them use it."""

    requested: str  # avx2 | native
    capability: str  # what ATen dispatches to in the ranks, lower case: "avx2", "avx512", ...
    env: dict[str, str] = field(default_factory=dict)  # exported to the ranks; empty when not pinned
    note: str | None = None  # why the requested pin does not apply here
    vendor: str = "unknown"  # the CPU's maker (cpu_vendor): the same kernels round alike only on one vendor's CPUs

    @property
    def pinned(self) -> bool:
        return bool(self.env)

    @property
    def device_class(self) -> str:
        return f"cpu-{'pinned' if self.pinned else 'native'}-{self.capability}-{self.vendor}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "capability": self.capability,
            "env": dict(self.env),
            "note": self.note,
            "vendor": self.vendor,
        }


# /proc/cpuinfo's vendor_id -> the vendor in a device class.
VENDORS = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}
CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo(field_name: str) -> str:
    """The first value of ``field_name`` in /proc/cpuinfo, "" where there is none."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return ""
    line = next((line for line in text.splitlines() if line.split(":")[0].strip() == field_name), "")
    return line.partition(":")[2].strip()


def _cpu_flags() -> set[str]:
    return set(_cpuinfo("flags").split())


def cpu_vendor() -> str:
    """``intel``, ``amd``, another vendor's id in lower case, or ``unknown``."""
    vendor_id = _cpuinfo("vendor_id")
    return VENDORS.get(vendor_id, vendor_id.lower() or "unknown")


def cpu_pin(requested: str = "avx2") -> CpuPin:
    """Resolves ``--cpu-isa``: AVX2 where the machine is x86-64 with AVX2 and FMA, native otherwise.

    The native capability is the one this process's torch dispatches to, which honours an
    ATEN_CPU_CAPABILITY the user exported; the ranks inherit it.
    """
    if requested not in CPU_ISAS:
        raise ValueError(f"--cpu-isa: expected one of {', '.join(CPU_ISAS)}, got {requested!r}")
    native, vendor = torch.backends.cpu.get_cpu_capability().lower(), cpu_vendor()
    if requested == "native":
        return CpuPin("native", native, vendor=vendor)
    if platform.machine().lower() not in ("x86_64", "amd64"):
        note = f"the AVX2 pin needs x86-64, this is {platform.machine()}: running native"
        return CpuPin("avx2", native, note=note, vendor=vendor)
    if not {"avx2", "fma"} <= _cpu_flags():
        return CpuPin("avx2", native, note="this CPU lacks AVX2 or FMA: running native", vendor=vendor)
    return CpuPin("avx2", "avx2", dict(AVX2_PIN), vendor=vendor)


def git_sha() -> str | None:
    """HEAD of the harness checkout, "-dirty" when it has local changes; None for an installed package
    (never the commit of some repository that happens to hold the site-packages) or without git."""
    if not in_checkout():
        return None
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=SOURCE_ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=SOURCE_ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def versions() -> dict[str, str | None]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "harness": harness.__version__,
        "git_sha": git_sha(),
    }


# What a run's numbers depend on besides the code: the device class (the CPU ISA and vendor, or the
# GPU model: the env key's first part), then each library and version on the way. A golden records
# it as provenance; a run that fails its golden compares it with its own to tell drift from a
# regression (golden.py). Ordered as a reader scans a change: hardware, then the toolchain.
FINGERPRINT_KEYS = ("device", "cpu_isa", "gpu", "driver", "torch", "cuda", "cudnn", "nccl", "mkl", "onednn", "python")
NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")


def fingerprint(device: str, pin: CpuPin | None = None) -> dict[str, str | None]:
    """This run's environment, every key of FINGERPRINT_KEYS: a field that does not bear on the run's
    numbers is null. A CPU run's GPU fields (cuda, cudnn, nccl, gpu, driver) are null on any build,
    so a golden recorded on a CPU runner and one recorded on a GPU host's CPUs differ only where
    their numbers can; a GPU run's cpu_isa is null."""
    config = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([0-9.]+)\S* Build (\d+)", config)
    onednn = re.search(r"MKL-DNN v([0-9.]+)", config)
    cuda = device == "cuda"
    return {
        "device": device_class(device, pin),
        "cpu_isa": None if cuda else (pin or cpu_pin()).capability,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "driver": _nvidia_driver() if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": _dotted(torch.backends.cudnn.version()) if cuda and torch.backends.cudnn.is_available() else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda and dist.is_nccl_available() else None,
        "mkl": f"{mkl[1]} build {mkl[2]}" if mkl else None,
        "onednn": onednn[1] if onednn else None,
        "python": platform.python_version(),
    }


def _dotted(cudnn: int | None) -> str | None:
    """cuDNN's version number as torch reports it in dotted form: 90100 -> "9.1.0" (cuDNN 9 on), 8902 -> "8.9.2"."""
    if cudnn is None:
        return None
    major = 10000 if cudnn >= 90000 else 1000
    return f"{cudnn // major}.{cudnn % major // 100}.{cudnn % 100}"


def _nvidia_driver() -> str | None:
    """The NVIDIA kernel driver's version ("550.54.15"), None where it cannot be read."""
    try:
        text = NVIDIA_DRIVER.read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module(?: for \S+)?\s+([0-9][0-9.]*)", text)
    return match[1] if match else None


def device_class(device: str, pin: CpuPin | None = None) -> str:
    """ "cpu-pinned-avx2-intel", "cpu-native-avx512-amd", or "cuda-<gpu model>" such as "cuda-h200"."""
    if device == "cuda":
        return "cuda-" + torch.cuda.get_device_name(0).lower().removeprefix("nvidia ").split()[0]
    return (pin or cpu_pin()).device_class


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def _slug(what: str, value: str) -> str:
    slug = re.sub(r"[^a-z0-9.]+", "-", value.lower()).strip("-")
    if not slug:
        raise ValueError(f"env_key: {what} {value!r} is empty")
    return slug


def env_key(device: str, backend: str, dtype: str, torch_version: str) -> str:
    """Names the environment a golden is valid for: "cpu-pinned-avx2-intel-gloo-float32-torch2.13",
    "cuda-h200-nccl-bfloat16-torch2.13".

    device is the device class ("cpu-pinned-avx2-amd", or a GPU class such as "cuda-h200"); only torch's
    major.minor counts, since patch releases rarely move numerics and would churn goldens.
    """
    match = re.match(r"(\d+)\.(\d+)", torch_version)
    if not match:
        raise ValueError(f"env_key: torch version {torch_version!r} does not start with major.minor")
    dtype = dtype.removeprefix("torch.")
    parts = [_slug("device", device), _slug("backend", backend), _slug("dtype", dtype)]
    return "-".join(parts + [f"torch{match[1]}.{match[2]}"])


# The collective backends torch.distributed names; an env key's backend is one of them.
BACKENDS = ("gloo", "nccl", "mpi")


class EnvKey(NamedTuple):
    """An env key's parts: the device class, backend, dtype and torch major.minor ("torch2.13")."""

    device: str
    backend: str
    dtype: str
    torch: str

    @property
    def environment(self) -> str:
        """The key without its dtype ("cpu-pinned-avx2-amd-gloo-torch2.13"): the machine class and
        toolchain whose goldens of every dtype ``harness golden table`` shows in one column."""
        return f"{self.device}-{self.backend}-{self.torch}"


def split_env_key(key: str) -> EnvKey:
    """The parts of a key env_key made; ValueError for any other string. Split at the backend,
    since a device class ("cpu-pinned-avx2-amd") and a dtype ("bf16-mixed") may both hold dashes."""
    match = re.fullmatch(rf"(.+?)-({'|'.join(BACKENDS)})-(.+)-(torch\d+\.\d+)", key)
    if not match:
        raise ValueError(f"{key!r} is not <device class>-<{'|'.join(BACKENDS)}>-<dtype>-torch<major.minor>")
    return EnvKey(*match.groups())


def comparable_env_keys(key: str, recorded: Iterable[str]) -> list[str]:
    """The env keys among ``recorded`` whose golden a run keyed ``key`` may compare with at the
    cross-environment tier: same device family (cpu, cuda), backend and dtype. Best first: same
    torch, then pinned. Strings that are no env key are passed over."""
    mine = split_env_key(key)
    found = []
    for other in recorded:
        try:
            parts = split_env_key(other)
        except ValueError:
            continue
        family = parts.device.split("-")[0] == mine.device.split("-")[0]
        if other != key and family and (parts.backend, parts.dtype) == (mine.backend, mine.dtype):
            found.append((parts.torch != mine.torch, "-pinned-" not in other, other))
    return [other for *_, other in sorted(found)]


def run_env_key(device: str, dtype: str, pin: CpuPin | None = None) -> str:
    """The env key a run on ``device`` records and looks its golden up under."""
    return env_key(device_class(device, pin), backend_for(device), dtype, torch.__version__)


def describe_environment(golden_dir: Path) -> dict[str, Any]:
    """What ``harness doctor`` prints: versions, devices, backends, the CPU pin, the env key runs use
    and the goldens recorded for it."""
    cuda = torch.cuda.is_available()
    pin = cpu_pin()
    key = run_env_key("cpu", "float32", pin)
    recorded = sorted(p.parent.name for p in golden_dir.glob(f"*/{key}.json"))
    pinned = " ".join(f"{name}={value}" for name, value in pin.env.items())
    info: dict[str, Any] = {
        **versions(),
        "platform": platform.platform(),
        "executable": sys.executable,
        "cpus": len(os.sched_getaffinity(0)),
        "cpu isa": f"{pin.capability} ({'pinned: ' + pinned if pin.pinned else 'native'})",
        "cuda": torch.version.cuda if cuda else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "backends": {
            name: available()
            for name, available in (
                ("gloo", dist.is_gloo_available),
                ("nccl", dist.is_nccl_available),
                ("mpi", dist.is_mpi_available),
            )
        },
        "env key cpu": key,
        "fingerprint": ", ".join(f"{name} {value or 'null'}" for name, value in fingerprint("cpu", pin).items()),
        "goldens cpu": f"{len(recorded)} in {golden_dir}: {', '.join(recorded)}"
        if recorded
        else f"none in {golden_dir}",
    }
    if pin.note:
        info["cpu isa note"] = pin.note
    if cuda:
        info["env key cuda"] = run_env_key("cuda", "float32")
    return info


# Values cuBLAS accepts for deterministic kernels; the ranks export the first when it is unset.
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


@dataclass(frozen=True)
class Preflight:
    """One thing a GPU runner needs, whether it has it, and what was found."""

    item: str
    ok: bool
    detail: str


def cuda_preflight(ranks: int) -> list[Preflight]:
    """``harness doctor --device cuda``: what ``--device cuda --ranks N`` needs on this machine.

    A runner that lacks one of these would fail every suite the same way, as exit 3 after its
    retries; the preflight names each missing item up front. The GPU probe (a deterministic
    cuBLAS matmul on each GPU a rank would use) runs only where the GPUs are there to probe.
    """
    built = torch.version.cuda
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if built is None:
        cuda = Preflight("cuda", False, f"torch {torch.__version__} is built without CUDA")
    elif gpus == 0:
        shown = "unset" if visible is None else repr(visible)
        cuda = Preflight("cuda", False, f"torch (CUDA {built}) sees no GPU (CUDA_VISIBLE_DEVICES {shown})")
    else:
        cuda = Preflight("cuda", True, f"CUDA {built}, {gpus} GPUs: {torch.cuda.get_device_name(0)}")
    checks = [
        cuda,
        Preflight("gpus", gpus >= ranks, f"{gpus} visible, --ranks {ranks} needs {ranks} (one per rank)"),
        _nccl(),
        _cublas_workspace(),
        _deterministic_algorithms(),
    ]
    if gpus:
        checks.append(_deterministic_matmul(min(gpus, ranks)))
    return checks


def _nccl() -> Preflight:
    if not dist.is_nccl_available():
        return Preflight("nccl", False, "torch.distributed has no NCCL backend in this build")
    version = ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else "?"
    return Preflight("nccl", True, f"NCCL {version}")


def _cublas_workspace() -> Preflight:
    value = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if value is None:
        return Preflight("CUBLAS_WORKSPACE_CONFIG", True, f"unset: the ranks set {DETERMINISTIC_CUBLAS[0]}")
    wanted = " or ".join(DETERMINISTIC_CUBLAS)
    if value in DETERMINISTIC_CUBLAS:
        return Preflight("CUBLAS_WORKSPACE_CONFIG", True, value)
    return Preflight(
        "CUBLAS_WORKSPACE_CONFIG", False, f"{value!r} in the environment; deterministic cuBLAS needs {wanted}"
    )


def _deterministic_algorithms() -> Preflight:
    """Whether torch accepts deterministic-only mode, which the ranks switch on; the setting is restored."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        return Preflight("deterministic algorithms", True, "torch.use_deterministic_algorithms(True) accepted")
    except Exception as e:
        return Preflight("deterministic algorithms", False, f"torch.use_deterministic_algorithms(True): {e}")
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _deterministic_matmul(gpus: int) -> Preflight:
    """A matmul on each GPU a rank would use, deterministic and under the workspace the ranks set: a
    GPU that is busy, faulty or refuses deterministic cuBLAS shows here, not as a rank's crash."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS[0])
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for index in range(gpus):
            ones = torch.ones(64, 64, device=f"cuda:{index}")
            if not torch.equal(ones @ ones, torch.full_like(ones, 64.0)):
                return Preflight("deterministic cuBLAS", False, f"cuda:{index}: a 64x64 matmul of ones is not 64")
    except Exception as e:  # an unusable GPU: CUDA and cuBLAS report it as RuntimeError or worse
        return Preflight("deterministic cuBLAS", False, f"cuda:{index}: {type(e).__name__}: {e}")
    finally:
        torch.use_deterministic_algorithms(before)
    return Preflight("deterministic cuBLAS", True, f"a deterministic matmul ran on {gpus} GPU(s)")
