"""The quality check after every run: proof that the run left its worker as clean as it found it.

A run passes when no process of it survives in its cgroups, every cgroup was recycled for the next run
or removed, the worker is alive and answered, and the worker's fingerprint (its processes, mounts,
descriptors and staging area) equals the one it had when it started. A failed check discards the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tether.sandbox.cgroups import RunCgroup
from tether.sandbox.protocol import RunReply
from tether.sandbox.result import QcStatus
from tether.sandbox.worker import Worker


@dataclass(slots=True)
class QualityReport:
    passed: bool
    reasons: list[str] = field(default_factory=list)
    # The run's groups that came back empty and were reset for another run (see `RunCgroup.recycle`).
    recycled: list[RunCgroup] = field(default_factory=list)

    @property
    def status(self) -> QcStatus:
        return QcStatus.PASSED if self.passed else QcStatus.FAILED


def quality_check(worker: Worker, reply: RunReply | None, cgroups: list[RunCgroup]) -> QualityReport:
    reasons = []
    recycled = []
    if reply is None:
        reasons.append("the worker did not return a result")
    elif reply.fingerprint != worker.baseline_fingerprint:
        reasons.append("the worker's fingerprint changed (processes, mounts, descriptors or staging)")
    if not worker.alive:
        reasons.append("the worker process is gone")
    for group in cgroups:
        survivors = group.live_pids()
        if survivors:
            reasons.append(f"{len(survivors)} process(es) outlived the run in its cgroup")
        elif group.recycle():
            recycled.append(group)
            continue
        if not group.remove():
            reasons.append("a run cgroup could not be removed")
    return QualityReport(not reasons, reasons, recycled)
