"""Accelerator topology from `nvidia-smi topo -m` (captured samples) and device assignment by island."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tether.scheduler.devices import assign_devices, detect_islands, parse_topology_matrix, visible_devices
from tether.scheduler.local import MachineCapacity

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize(
    ("sample", "islands"),
    [
        ("topo_dgx_h100.txt", ((0, 1, 2, 3, 4, 5, 6, 7),)),  # an 8-GPU NVSwitch box: one island
        ("topo_pcie_4gpu.txt", ((0,), (1,), (2,), (3,))),  # PCIe only: every GPU alone
        ("topo_nvlink_pairs.txt", ((0, 1), (2, 3))),  # NVLink bridges join pairs
    ],
)
def test_nvlink_islands_are_read_from_the_topology_matrix(
    sample: str, islands: tuple[tuple[int, ...], ...]
) -> None:
    assert parse_topology_matrix((DATA / sample).read_text()) == islands


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", "no GPU matrix"),
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\t0-7\n", "names 2 GPUs but has rows for 1"),
    ],
)
def test_output_without_a_whole_matrix_is_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_topology_matrix(text)


def test_a_job_gets_the_smallest_island_that_holds_it_whole() -> None:
    pairs = ((0, 1), (2, 3))
    assert assign_devices(pairs, held={0}, want=2) == (2, 3)  # not 1 and 2 across PCIe
    assert assign_devices(pairs, held={0}, want=1) == (1,)  # fill the broken pair first
    assert assign_devices(pairs, held={0, 2}, want=2) == (1, 3)  # no whole pair left: lowest free
    assert assign_devices(pairs, held={0, 1, 2}, want=2) is None
    assert assign_devices(pairs, held={0, 1, 2, 3}, want=0) == ()


def test_a_cpu_job_sees_no_device_at_all() -> None:
    assert visible_devices(()) == "" and visible_devices((2, 3)) == "2,3"


def test_a_cpu_machine_is_one_island_and_islands_must_cover_its_devices() -> None:
    assert MachineCapacity(cpus=2, memory_mib=1024).islands == ()
    assert MachineCapacity(cpus=2, memory_mib=1024, accelerators=2).islands == ((0, 1),)
    assert MachineCapacity(cpus=2, memory_mib=1024).with_accelerators(2).islands == ((0, 1),)
    with pytest.raises(ValueError, match=r"must hold each accelerator index 0\.\.1 once"):
        MachineCapacity(cpus=2, memory_mib=1024, accelerators=2, islands=((0,), (0,)))


def test_islands_come_from_nvidia_smi_where_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\n[ \"$1 $2\" = 'topo -m' ] && cat {DATA / 'topo_nvlink_pairs.txt'}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert detect_islands(4) == ((0, 1), (2, 3))
    assert detect_islands(2) == ((0, 1),)  # the matrix disagrees with the device count: one island
    fake.write_text("#!/bin/sh\nexit 9\n")
    assert detect_islands(4) == ((0, 1, 2, 3),)  # nvidia-smi fails: one island


def test_a_machine_without_nvidia_smi_is_one_island(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect_islands(3) == ((0, 1, 2),) and detect_islands(0) == ()
