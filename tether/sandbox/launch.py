"""Start a sandbox worker's process, without an event loop and before knowing the pool's settings.

The process imports the zygote, then waits for its `WorkerInit` (`Worker.start` sends it and maps the
worker's ids). A command that knows it will start a local pool launches its workers first, so that
their interpreters and imports overlap the command's own; a launch no pool takes ends with this
process (the worker reads end of file, or gets its parent-death signal).
"""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass

# The folder holding this `tether` package: the worker imports the very code the host runs from it.
from tether.sandbox.forkserver import PACKAGE_ROOT

# Without `site` (-S): the worker needs only the standard library and this package, and a site with
# editable installs and .pth files costs a large share of an interpreter's start.
ZYGOTE_ENTRY = "import sys; sys.path.insert(0, sys.argv[1]); from tether.sandbox.zygote import main; main()"


@dataclass(slots=True)
class Launch:
    """A worker process started ahead of its pool: it imports the zygote, then waits for its
    `WorkerInit`. A command starts it before its own imports, which the worker's then overlap."""

    popen: subprocess.Popen[bytes]
    control: socket.socket
    fds: socket.socket
    python_executable: str

    def discard(self) -> None:
        """Kill the process, which holds nothing yet (it dies at once: no wait blocks), and close its
        sockets."""
        self.popen.kill()
        self.popen.wait()
        self.control.close()
        self.fds.close()


def launch(python_executable: str) -> Launch:
    """Start a worker process; `Worker.start` hands it its `WorkerInit` and maps its ids."""
    control, control_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fds, fds_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        popen = subprocess.Popen(
            [
                python_executable,
                "-I",
                "-S",
                "-c",
                ZYGOTE_ENTRY,
                PACKAGE_ROOT,
                str(control_child.fileno()),
                str(fds_child.fileno()),
            ],
            pass_fds=(control_child.fileno(), fds_child.fileno()),
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            # Its own session: a terminal's Ctrl-C goes to the caller, which decides (an agent finishes
            # its step first), instead of killing the sandbox under a running call.
            start_new_session=True,
        )
    except BaseException:
        for sock in (control, fds):
            sock.close()
        raise
    finally:
        control_child.close()
        fds_child.close()
    return Launch(popen, control, fds, python_executable)
