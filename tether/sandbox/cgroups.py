"""Per-run cgroups for memory, pids and CPU, on cgroup v1 or v2, created and read by the host.

The host creates each run's group, opens its `cgroup.procs` for the run to join (the descriptor is
passed into the sandbox, so the sandbox never sees cgroupfs), and afterwards reads peak memory and the
OOM-kill counter, which is how a memory-limit kill is told from any other exit. CPU time comes from the
run's rusage (its PID namespace reaps every descendant into it), so no cpuacct group is needed.

Creating and removing a group costs more than the run of a short program, so a group the quality check
found empty is recycled (`recycle`): its peak memory is reset and its OOM kills counted afresh, and the
next run gets a group with no process and no record of the last one. What the last run left charged
(page cache and kernel objects, reclaimable, a few hundred KiB) is uncharged once it passes
`RECYCLE_SLACK_BYTES`, which bounds what a recycled group's peak may count beyond a new one's. Only v1
can reset the peak; on v2 every run gets a new group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

REQUIRED_CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000  # the kernel's default CFS period, which a new v1 group starts with
# Charge a recycled group may carry into its next run before it is emptied (emptying costs a run's time).
RECYCLE_SLACK_BYTES = 1024 * 1024


class CgroupVersion(Enum):
    V1 = 1
    V2 = 2


@dataclass(frozen=True, slots=True)
class CgroupLimits:
    memory_bytes: int
    pids_max: int
    cpu_cores: float


@dataclass(frozen=True, slots=True)
class CgroupStats:
    peak_memory_kib: int
    oom_kills: int


@dataclass(frozen=True, slots=True)
class Hierarchy:
    mount_point: str
    controllers: frozenset[str]
    version: CgroupVersion


def parse_mountinfo(text: str) -> list[Hierarchy]:
    """Cgroup hierarchies from /proc/self/mountinfo (v1: controllers in super options; v2: unified)."""
    hierarchies = []
    for line in text.splitlines():
        pre, _, post = line.partition(" - ")
        fields, post_fields = pre.split(), post.split()
        if len(post_fields) < 3 or len(fields) < 5:
            continue
        fstype, super_options = post_fields[0], post_fields[2]
        if fstype == "cgroup":
            controllers = frozenset(
                o for o in super_options.split(",") if o not in ("rw", "ro") and "=" not in o
            )
            hierarchies.append(Hierarchy(fields[4], controllers, CgroupVersion.V1))
        elif fstype == "cgroup2":
            hierarchies.append(Hierarchy(fields[4], frozenset(), CgroupVersion.V2))
    return hierarchies


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """Map each v1 controller (and '' for v2) to this process's group path, from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            paths[controller] = parts[2]
    return paths


@dataclass(frozen=True, slots=True)
class CgroupLayout:
    """Where each controller's groups are created for this process."""

    version: CgroupVersion
    bases: dict[str, Path]  # controller -> directory under which run groups are created

    @property
    def directories(self) -> list[Path]:
        return sorted(set(self.bases.values()))


def detect_layout(
    mountinfo: str, proc_cgroup: str, v2_controllers: set[str] | None, namespace: str = "tether"
) -> CgroupLayout | None:
    """Pick v1 when every required controller has a v1 hierarchy, else v2 when it offers them all."""
    own_paths = parse_proc_cgroup(proc_cgroup)
    hierarchies = parse_mountinfo(mountinfo)
    v1: dict[str, Path] = {}
    for hierarchy in hierarchies:
        if hierarchy.version is CgroupVersion.V1:
            for controller in hierarchy.controllers & set(REQUIRED_CONTROLLERS):
                own = own_paths.get(controller, "/").lstrip("/")
                v1[controller] = Path(hierarchy.mount_point) / own / namespace
    if all(c in v1 for c in REQUIRED_CONTROLLERS):
        return CgroupLayout(CgroupVersion.V1, v1)
    unified = [h for h in hierarchies if h.version is CgroupVersion.V2]
    if unified and v2_controllers is not None and set(REQUIRED_CONTROLLERS) <= v2_controllers:
        own = own_paths.get("", "/").lstrip("/")
        base = Path(unified[0].mount_point) / own / namespace
        return CgroupLayout(CgroupVersion.V2, dict.fromkeys(REQUIRED_CONTROLLERS, base))
    return None


def system_layout(namespace: str = "tether") -> CgroupLayout | None:
    mountinfo = Path("/proc/self/mountinfo").read_text()
    proc_cgroup = Path("/proc/self/cgroup").read_text()
    v2_controllers = None
    for hierarchy in parse_mountinfo(mountinfo):
        if hierarchy.version is CgroupVersion.V2:
            own = parse_proc_cgroup(proc_cgroup).get("", "/").lstrip("/")
            controllers_file = Path(hierarchy.mount_point) / own / "cgroup.controllers"
            with contextlib.suppress(OSError):
                v2_controllers = set(controllers_file.read_text().split())
            break
    return detect_layout(mountinfo, proc_cgroup, v2_controllers, namespace)


def _write(path: Path | str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: Path | str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536).decode()
    finally:
        os.close(fd)


def _read_keyed(path: Path | str) -> dict[str, int]:
    values = {}
    for line in _read(path).splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            values[key] = int(value)
    return values


class RunCgroup:
    """One run's groups (one directory per v1 hierarchy, one in total on v2)."""

    def __init__(self, layout: CgroupLayout, name: str) -> None:
        self.layout = layout
        # Plain strings: these paths are built and used on every run.
        self.paths = {controller: f"{base}/{name}" for controller, base in layout.bases.items()}
        self.directories = sorted(set(self.paths.values()))
        # Every run process joins every hierarchy before it can fork, so the pids group lists them all.
        self._procs_file = f"{self.paths['pids']}/cgroup.procs"
        self.limits: CgroupLimits | None = None  # the limits last written, so a recycled group skips them
        self._oom_kills_before = 0  # the OOM-kill counter when the group was last recycled
        self._procs_fds: list[int] = []  # opened once, handed to every run of the group, closed on removal

    def create(self, limits: CgroupLimits) -> None:
        for directory in self.directories:
            os.mkdir(directory)
        self.apply(limits)

    def apply(self, limits: CgroupLimits) -> None:
        """Write the limits into the group (a no-op when they are the ones it already has)."""
        if limits == self.limits:
            return
        # v1 refuses a memory limit above the memory+swap one: a raised limit goes in after memsw.
        raising = self.limits is not None and limits.memory_bytes > self.limits.memory_bytes
        self.limits = None  # until every file is written
        quota = max(int(limits.cpu_cores * CPU_PERIOD_US), 1000)
        if self.layout.version is CgroupVersion.V1:
            memory = self.paths["memory"]
            value = str(limits.memory_bytes)

            def swap_limit() -> None:  # only where swap accounting exists: its absence is no error
                with contextlib.suppress(FileNotFoundError):
                    _write(f"{memory}/memory.memsw.limit_in_bytes", value)

            if raising:
                swap_limit()
            _write(f"{memory}/memory.limit_in_bytes", value)
            if not raising:
                swap_limit()
            _write(f"{self.paths['pids']}/pids.max", str(limits.pids_max))
            _write(f"{self.paths['cpu']}/cpu.cfs_quota_us", str(quota))
        else:
            group = self.paths["memory"]
            _write(f"{group}/memory.max", str(limits.memory_bytes))
            with contextlib.suppress(FileNotFoundError):
                _write(f"{group}/memory.swap.max", "0")
            _write(f"{group}/pids.max", str(limits.pids_max))
            _write(f"{group}/cpu.max", f"{quota} {CPU_PERIOD_US}")
        self.limits = limits

    def procs_fds(self) -> list[int]:
        """Write-only descriptors of each group's `cgroup.procs`; writing "0" moves the writer in.

        The group keeps them until it is removed: a recycled group's next run gets the same ones (the
        sandbox receives copies and closes them), which spares every run opening and closing them.
        """
        if not self._procs_fds:
            self._procs_fds = [
                os.open(f"{directory}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
                for directory in self.directories
            ]
        return self._procs_fds

    def _close_procs_fds(self) -> None:
        for fd in self._procs_fds:
            os.close(fd)
        self._procs_fds = []

    def stats(self) -> CgroupStats:
        if self.layout.version is CgroupVersion.V1:
            memory = self.paths["memory"]
            peak = int(_read(f"{memory}/memory.max_usage_in_bytes"))
            oom_kills = _read_keyed(f"{memory}/memory.oom_control").get("oom_kill", 0)
            return CgroupStats(peak // 1024, oom_kills - self._oom_kills_before)
        group = self.paths["memory"]
        peak_file = f"{group}/memory.peak"
        peak = int(_read(peak_file)) if os.path.exists(peak_file) else 0
        oom_kills = _read_keyed(f"{group}/memory.events").get("oom_kill", 0)
        return CgroupStats(peak // 1024, oom_kills)

    def live_pids(self) -> set[int]:
        try:
            return {int(pid) for pid in _read(self._procs_file).split()}
        except FileNotFoundError:
            return set()

    def recycle(self) -> bool:
        """Make the group, which the caller found empty (`live_pids`), as a new one for the next run: its
        memory uncharged, its peak and OOM kills reset. False when it cannot be (v2, the kernel refused):
        remove it then. No process can enter it meanwhile: only this process holds its `cgroup.procs`."""
        if self.layout.version is not CgroupVersion.V1:
            return False
        memory = self.paths["memory"]
        try:
            if int(_read(f"{memory}/memory.usage_in_bytes")) > RECYCLE_SLACK_BYTES:
                _write(f"{memory}/memory.force_empty", "0")
            _write(f"{memory}/memory.max_usage_in_bytes", "0")
            self._oom_kills_before = _read_keyed(f"{memory}/memory.oom_control").get("oom_kill", 0)
        except OSError:
            return False
        return True

    def remove(self, grace_s: float = 2.0) -> bool:
        """Remove the groups, killing whatever is left in them first. False if that failed."""
        self._close_procs_fds()
        deadline = time.monotonic() + grace_s
        remaining = list(self.directories)
        while remaining:
            try:
                os.rmdir(remaining[0])
                remaining.pop(0)
            except FileNotFoundError:
                remaining.pop(0)
            except OSError:
                if time.monotonic() > deadline:
                    return False
                for pid in self.live_pids():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.002)
        return True


def prepare_layout(layout: CgroupLayout) -> None:
    """Create the namespace directories; on v2 also delegate the controllers down to them."""
    for directory in layout.directories:
        directory.mkdir(parents=True, exist_ok=True)
        if layout.version is CgroupVersion.V2:
            wanted = " ".join(f"+{c}" for c in REQUIRED_CONTROLLERS)
            with contextlib.suppress(OSError):
                _write(directory.parent / "cgroup.subtree_control", wanted)
            _write(directory / "cgroup.subtree_control", wanted)


def check_layout(layout: CgroupLayout, name: str) -> None:
    """Create, limit, read and remove one group, raising the `OSError` of the first step that fails: a
    hierarchy can exist and still be unusable (mounted read-only in a non-privileged container)."""
    group = RunCgroup(layout, name)
    try:
        group.create(CgroupLimits(memory_bytes=64 * 1024 * 1024, pids_max=16, cpu_cores=1.0))
        group.stats()
    finally:
        group.remove()


def remove_stale_groups(layout: CgroupLayout) -> int:
    """Remove empty run groups left by pool processes that no longer exist (`<pid>-<n>` names)."""
    removed = 0
    for directory in layout.directories:
        if not directory.is_dir():
            continue
        for child in directory.iterdir():
            owner = child.name.split("-", 1)[0]
            if child.is_dir() and owner.isdigit() and not Path(f"/proc/{owner}").exists():
                with contextlib.suppress(OSError):
                    child.rmdir()
                    removed += 1
    return removed
