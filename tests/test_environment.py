"""The environment a golden is owed by: the CPU kernel pin and the vendor in the device class."""

from __future__ import annotations

from pathlib import Path

import pytest

import harness.environment as environment
from harness.environment import CpuPin, cpu_pin, cpu_vendor, run_env_key
from harness.golden import comparable_goldens

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
    suite = tmp_path / "parity"
    suite.mkdir()
    amd = suite / "cpu-pinned-avx2-amd-gloo-float32-torch2.13.json"
    amd.write_text("{}")
    assert comparable_goldens(suite, "cpu-pinned-avx2-intel-gloo-float32-torch2.13") == [amd]


def test_the_pin_round_trips_through_the_manifest() -> None:
    pin = CpuPin("avx2", "avx2", {"ATEN_CPU_CAPABILITY": "avx2"}, vendor="intel")
    assert CpuPin(**pin.to_dict()) == pin  # harness collect rebuilds it from manifest.json
