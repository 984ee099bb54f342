"""A burst of mixed runs leaves nothing behind: no run process, no run cgroup, no mount point."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections import Counter
from pathlib import Path

from tether.sandbox import PoolConfig, RunStatus, SandboxPool, SandboxSpec
from tether.sandbox.cgroups import system_layout

MIXED = [
    ("print('ok')", "python", RunStatus.OK),
    ("raise SystemExit(2)", "python", RunStatus.RUNTIME_ERROR),
    ("import time\ntime.sleep(5)", "python", RunStatus.TIMEOUT),
    ("x = bytearray(1 << 30)", "python", RunStatus.MEMORY_LIMIT),
    ("yes | head -c 10000000", "bash", RunStatus.OUTPUT_LIMIT),
    ("bomb() { bomb | bomb & }; bomb; sleep 5", "bash", RunStatus.TIMEOUT),
    ("int main( {", "c", RunStatus.COMPILE_ERROR),
    ("(sleep 30 &) ; echo started", "bash", RunStatus.OK),
]


def _run_uid_processes(run_uid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                uid_line = next(
                    line for line in (entry / "status").read_text().splitlines() if line.startswith("Uid:")
                )
            except (OSError, StopIteration):
                continue
            if int(uid_line.split()[1]) == run_uid:
                found.append(int(entry.name))
    return found


async def test_mixed_burst_leaves_the_host_clean() -> None:
    spec = SandboxSpec(timeout_s=1, memory_mib=64, output_limit_kib=64, pids_max=32)
    config = PoolConfig(slots=2, host_uid_base=1_500_000)
    async with SandboxPool(spec, config) as pool:
        jobs = [MIXED[i % len(MIXED)] for i in range(48)]
        results = await asyncio.gather(*(pool.run(code, language=language) for code, language, _ in jobs))
        statuses = Counter(result.status for result in results)
        assert all(r.status is expected for r, (_, _, expected) in zip(results, jobs, strict=True)), statuses
        assert all(r.qc == "passed" for r in results), [r.qc_detail for r in results if r.qc != "passed"]
        assert pool.workers_replaced == 0
        assert _run_uid_processes(config.host_uid_base + config.run_uid) == []
    layout = system_layout()
    assert layout is not None
    leftovers = [p for d in layout.directories for p in d.iterdir() if p.name.startswith(f"{os.getpid()}-")]
    assert leftovers == []
    assert [
        p for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(f"tether-root-{os.getpid()}-")
    ] == []
