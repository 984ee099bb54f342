"""The job queue, indexed three ways (submit order, priority level, tenant) so policies never sort it.

A requeued job (preempted, or moved off a straggler) keeps its original place in submit order.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator

from tether.scheduler.job import Job

_Key = tuple[float, int]


class _SortedJobs:
    def __init__(self) -> None:
        self.keys: list[_Key] = []
        self.jobs: list[Job] = []

    def add(self, key: _Key, job: Job) -> None:
        index = bisect.bisect(self.keys, key)
        self.keys.insert(index, key)
        self.jobs.insert(index, job)

    def remove(self, key: _Key) -> None:
        index = bisect.bisect_left(self.keys, key)
        assert self.keys[index] == key, "removing a job that is not queued"
        del self.keys[index]
        del self.jobs[index]

    def head(self, limit: int) -> list[Job]:
        return self.jobs[:limit]


class JobQueue:
    def __init__(self) -> None:
        self._arrival = itertools.count()
        self._keys: dict[str, _Key] = {}
        self._queued: set[str] = set()
        self._all = _SortedJobs()
        self._by_priority: dict[int, _SortedJobs] = {}
        self._by_tenant: dict[str, _SortedJobs] = {}

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._queued

    def push(self, job: Job) -> None:
        assert job.job_id not in self._queued, f"job {job.job_id} is already queued"
        key = self._keys.get(job.job_id)
        if key is None:
            key = self._keys[job.job_id] = (job.spec.submit_s, next(self._arrival))
        self._queued.add(job.job_id)
        self._all.add(key, job)
        self._by_priority.setdefault(job.spec.priority, _SortedJobs()).add(key, job)
        self._by_tenant.setdefault(job.spec.tenant, _SortedJobs()).add(key, job)

    def remove(self, job: Job) -> None:
        key = self._keys[job.job_id]
        self._queued.remove(job.job_id)
        self._all.remove(key)
        self._by_priority[job.spec.priority].remove(key)
        self._by_tenant[job.spec.tenant].remove(key)

    def in_submit_order(self, limit: int) -> list[Job]:
        return self._all.head(limit)

    def by_priority(self, limit: int) -> Iterator[Job]:
        """Highest priority first, submit order within a level."""
        for level in sorted(self._by_priority, reverse=True):
            yield from self._by_priority[level].head(limit)

    def tenants(self) -> list[str]:
        return [tenant for tenant, jobs in self._by_tenant.items() if jobs.jobs]

    def of_tenant(self, tenant: str, limit: int) -> list[Job]:
        jobs = self._by_tenant.get(tenant)
        return jobs.head(limit) if jobs else []
