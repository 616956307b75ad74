"""The environment a golden is owed by: the CPU kernel pin and the vendor in the device class, and the
fingerprint a golden records to tell drift from a regression."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

import harness.environment as environment
from harness.environment import (
    FINGERPRINT_KEYS,
    CpuPin,
    comparable_env_keys,
    cpu_pin,
    cpu_vendor,
    describe_environment,
    fingerprint,
    run_env_key,
)

CPUINFO = "processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\n"


@pytest.fixture
def cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A /proc/cpuinfo naming ``vendor``, as cpu_pin reads it."""

    def make(vendor: str) -> None:
        path = tmp_path / f"cpuinfo-{vendor}"
        path.write_text(CPUINFO.format(vendor=vendor))
        monkeypatch.setattr(environment, "CPUINFO", path)

    return make


@pytest.mark.parametrize(
    ("vendor_id", "vendor"), [("GenuineIntel", "intel"), ("AuthenticAMD", "amd"), ("HygonGenuine", "hygongenuine")]
)
def test_the_pinned_device_class_names_the_cpu_vendor(cpuinfo, vendor_id: str, vendor: str) -> None:
    """MKL's pinned code path rounds alike only on one vendor's CPUs: an Intel run must never be held
    bitwise to a golden an AMD machine recorded."""
    cpuinfo(vendor_id)
    assert cpu_vendor() == vendor
    pin = cpu_pin("avx2")
    assert pin.pinned and pin.device_class == f"cpu-pinned-avx2-{vendor}"
    assert run_env_key("cpu", "float32", pin).startswith(f"cpu-pinned-avx2-{vendor}-gloo-float32-torch")
    assert cpu_pin("native").device_class.endswith(f"-{vendor}")


def test_another_vendors_golden_is_compared_at_the_cross_environment_tier(tmp_path: Path) -> None:
    amd = "cpu-pinned-avx2-amd-gloo-float32-torch2.13"
    assert comparable_env_keys("cpu-pinned-avx2-intel-gloo-float32-torch2.13", [amd, "not-a-key"]) == [amd]


def test_the_pin_round_trips_through_the_manifest() -> None:
    pin = CpuPin("avx2", "avx2", {"ATEN_CPU_CAPABILITY": "avx2"}, vendor="intel")
    assert CpuPin(**pin.to_dict()) == pin  # harness collect rebuilds it from manifest.json


BUILT_WITH = """PyTorch built with:
  - GCC 13.3
  - Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605 for Intel(R) 64 architecture applications
  - Intel(R) MKL-DNN v3.12.0 (Git Hash 80afa71049cd69a3df32adcccb623b12cd7baa22)
"""


def test_a_cpu_runs_fingerprint_names_its_libraries_and_nulls_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.__config__, "show", lambda: BUILT_WITH)
    pin = CpuPin("avx2", "avx2", {"ATEN_CPU_CAPABILITY": "avx2"}, vendor="intel")
    found = fingerprint("cpu", pin)
    assert list(found) == list(FINGERPRINT_KEYS)
    assert found == {
        "device": "cpu-pinned-avx2-intel", "cpu_isa": "avx2", "gpu": None, "driver": None,
        "torch": torch.__version__, "cuda": None, "cudnn": None, "nccl": None,
        "mkl": "2024.2 build 20240605", "onednn": "3.12.0", "python": platform.python_version(),
    }  # fmt: skip
    monkeypatch.setattr(torch.__config__, "show", lambda: "PyTorch built with:\n  - GCC 13.3\n")
    assert (fingerprint("cpu", pin)["mkl"], fingerprint("cpu", pin)["onednn"]) == (None, None)  # e.g. aarch64
    assert describe_environment(Path("golden"))["fingerprint"].startswith("device cpu-")  # harness doctor


def test_a_gpu_runs_fingerprint_names_the_gpu_its_driver_and_cuda_libraries(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No GPU here: torch's answers are stated, the formatting and the driver file's parsing are real."""
    driver = tmp_path / "version"
    driver.write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build  (dvs-builder@U16)\n"
    )
    monkeypatch.setattr(environment, "NVIDIA_DRIVER", driver)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    monkeypatch.setattr(environment.dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 26, 2))
    found = fingerprint("cuda")
    assert {key: found[key] for key in ("device", "cpu_isa", "gpu", "driver", "cuda", "cudnn", "nccl")} == {
        "device": "cuda-h200", "cpu_isa": None, "gpu": "NVIDIA H200", "driver": "550.54.15", "cuda": "12.8",
        "cudnn": "9.1.0", "nccl": "2.26.2",
    }  # fmt: skip
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024\n")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 8902)
    assert (fingerprint("cuda")["driver"], fingerprint("cuda")["cudnn"]) == ("535.183.01", "8.9.2")
