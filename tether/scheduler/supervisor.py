"""The process that owns one local job: runs its command, records how it ended, then schedules the queue.

Started by the local back end as a session leader (`python -m tether.scheduler.supervisor DB JOB_ID`),
so the job's processes share its process group and a cancel or preemption kills them all at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tether.scheduler.job import JobState
from tether.scheduler.local import LocalBackend


def supervise(db_path: Path, job_id: int) -> int:
    backend = LocalBackend.open(db_path)
    record = backend.get(job_id)
    with open(record.log_path, "ab") as log:
        try:
            exit_code = subprocess.run(
                list(record.request.command), stdin=subprocess.DEVNULL, stdout=log, stderr=log, check=False
            ).returncode
            reason = "" if exit_code == 0 else f"exited with status {exit_code}"
        except OSError as error:
            exit_code, reason = 127, f"could not start: {error}"
            log.write(f"tether: {reason}\n".encode())
    with backend.store.transaction():
        current = backend.get(job_id)
        # A cancel or preemption has already rewritten the record; only a job still ours is finished here.
        if current.state is JobState.RUNNING and current.pid == os.getpid():
            state = JobState.DONE if exit_code == 0 else JobState.FAILED
            backend.store.mark_finished(job_id, state, backend.clock(), exit_code, reason)
    backend.schedule()
    return 0


if __name__ == "__main__":
    sys.exit(supervise(Path(sys.argv[1]), int(sys.argv[2])))
