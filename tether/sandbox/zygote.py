"""The sandbox worker: enters its namespaces once, pivots into the read-only root, then serves runs.

Started by the host (`worker.py`) as `python -I -S -c ENTRY PACKAGE_ROOT CTRL_FD FDS_FD`. The launcher
process takes new user, mount, network, IPC, UTS and PID namespaces, waits for the host to write its
uid/gid maps, and forks the zygote, PID 1 of the worker's PID namespace, so that killing the launcher
(or the host dying) takes every run with it. The zygote starts the fork server (which preloads the
standard library), then serves run requests one at a time: each run gets a fresh tmpfs, PID, mount
and IPC namespaces and the cgroups the host passed in. It never decides a run's status: it reports raw
outcomes, the host classifies them.

Runs are not forked from the zygote but from the fork server (`forkserver.py`), a fresh interpreter
that never holds a run's data, so no run can read what an earlier one left in memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import socket
import stat
import struct
import sys
import time

from tether.sandbox import forkserver, linux, protocol
from tether.sandbox.linux import MNT_DETACH, Clone, Mount
from tether.sandbox.paths import FIXED_ROOTS, PROGRAM_DIR, locate
from tether.sandbox.plan import ChildPlan, encode_plan
from tether.sandbox.protocol import RunReply, RunRequest, StepOutcome, StepRequest, WorkerInit
from tether.sandbox.rootfs import STAGING, build_root

TYPE_CHECKING = False
if TYPE_CHECKING:  # typeshed has no stubs for the builtin digest module: hashlib's is the same type
    from hashlib import sha256
else:
    try:  # the builtin digest: hashlib loads OpenSSL, a large share of a worker's start-up imports
        from _sha256 import sha256
    except ImportError:  # a build without it (3.12 names it _sha2)
        from hashlib import sha256

# The folders of a run directory: the writable roots (see paths.py) and the host-only stdin.
RUN_FOLDERS = (("work", 0o755), ("tmp", 0o1777), ("shm", 0o1777), ("mnt", 0o755), ("meta", 0o700))
WORKER_NAMESPACES = Clone.NEWUSER | Clone.NEWNS | Clone.NEWNET | Clone.NEWIPC | Clone.NEWUTS | Clone.NEWPID
_READ_CHUNK = 65536


def _bring_loopback_up() -> None:
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def fingerprint(kept_dirs: frozenset[str] = frozenset()) -> str:
    """A digest of everything a run could have left behind in the worker: processes, mounts, fds, staging.

    Run directories kept on purpose (sessions) are left out, so a worker holding a session still
    matches its baseline. Mount ids are hashed too: a released run's mounts are all gone, so any
    difference from the baseline is a leftover.
    """
    kept_mounts = tuple(f" {STAGING}/{name} " for name in kept_dirs)
    digest = sha256()
    digest.update(" ".join(sorted(name for name in os.listdir("/proc") if name.isdigit())).encode())
    fd = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
    try:
        mountinfo = b""
        while chunk := os.read(fd, 65536):
            mountinfo += chunk
    finally:
        os.close(fd)
    lines = mountinfo.decode().splitlines()
    if kept_mounts:  # only a worker holding a session: every other run hashes the lines in one call
        lines = [line for line in lines if not any(marker in line for marker in kept_mounts)]
    digest.update("".join(lines).encode())
    staged = sorted(set(os.listdir(STAGING)) - kept_dirs)
    digest.update(f"|{len(os.listdir('/proc/self/fd'))}|{staged}".encode())
    return digest.hexdigest()


class Zygote:
    def __init__(
        self,
        control: socket.socket,
        fd_channel: socket.socket,
        init: WorkerInit,
        forker: socket.socket,
        shadows: list[tuple[str, str]],
    ) -> None:
        self.control = control
        self.fd_channel = fd_channel
        self.init = init
        self.forker = forker
        self.shadows = shadows
        self.run_dirs: set[str] = set()

    def serve(self) -> None:
        while True:
            try:
                message = protocol.recv_frame(self.control)
            except EOFError:
                return
            op = message.pop("op")
            if op == "run":
                reply = self.run(protocol.run_request_from(message))
                protocol.send_frame(self.control, {"op": "result", **protocol.to_json(reply)})
            elif op == "download":
                try:
                    files, missing = self._collect(message["dir_id"], message["paths"])
                except (OSError, ValueError) as error:
                    protocol.send_frame(self.control, {"op": "error", "error": f"download failed: {error}"})
                    continue
                protocol.send_frame(self.control, {"op": "files", "files": files, "missing": missing})
            elif op == "release":
                self._release(message["dir_id"])
                protocol.send_frame(
                    self.control, {"op": "released", "fingerprint": fingerprint(frozenset(self.run_dirs))}
                )
            elif op == "shutdown":
                return
            else:
                protocol.send_frame(self.control, {"op": "error", "error": f"unknown op {op!r}"})

    def run(self, request: RunRequest) -> RunReply:
        """Run the request's steps. A failure keeps a directory that existed before (a session's)."""
        total_fds = sum(step.cgroup_fd_count for step in request.steps)
        cgroup_fds = self._receive_fds(total_fds)
        existed = request.dir_id in self.run_dirs
        outcomes: list[StepOutcome] = []
        files: dict[str, str] = {}
        missing: list[str] = []
        error: str | None = None
        try:
            run_dir = self._prepare(request)
            # `_enter.c` binds the workdir, /tmp and /dev/shm itself; these go before the shadows,
            # which may lie under them.
            binds = [(f"{run_dir}/{FIXED_ROOTS['/mnt']}", "/mnt")]
            if request.program:
                binds.append((f"{run_dir}/program", PROGRAM_DIR))
            offset = 0
            for step in request.steps:
                fds = cgroup_fds[offset : offset + step.cgroup_fd_count]
                offset += step.cgroup_fd_count
                outcome = self._run_step(run_dir, step, fds, binds)
                outcomes.append(outcome)
                failed = outcome.exit_code != 0 or outcome.timed_out or outcome.output_exceeded
                if failed and request.stop_after_failure:
                    break
            files, missing = self._collect(request.dir_id, request.collect)
        except Exception as failure:
            error = f"{type(failure).__name__}: {failure}"
        finally:
            for fd in cgroup_fds:
                os.close(fd)
        if not request.keep_dir or (error is not None and not existed):
            self._release(request.dir_id)
        return RunReply(outcomes, files, missing, fingerprint(frozenset(self.run_dirs)), error=error)

    def _receive_fds(self, count: int) -> list[int]:
        if count == 0:
            return []
        _, fds, _, _ = socket.recv_fds(self.fd_channel, 16, count)
        if len(fds) != count:
            for fd in fds:
                os.close(fd)
            raise RuntimeError(f"expected {count} cgroup descriptors, received {len(fds)}")
        return fds

    def _dir_path(self, dir_id: str) -> str:
        if not dir_id or "/" in dir_id or dir_id.startswith("."):
            raise ValueError(f"invalid run directory id {dir_id!r}")
        return f"{STAGING}/{dir_id}"

    def _prepare(self, request: RunRequest) -> str:
        run_dir = self._dir_path(request.dir_id)
        uid, gid = self.init.run_uid, self.init.run_gid
        if request.dir_id not in self.run_dirs:
            os.mkdir(run_dir, 0o700)
            self.run_dirs.add(request.dir_id)
            linux.mount(
                "tmpfs",
                run_dir,
                "tmpfs",
                Mount.NOSUID | Mount.NODEV,
                f"size={request.disk_mib}m,mode=0755,nr_inodes=65536",
            )
            for name, mode in RUN_FOLDERS:
                os.mkdir(f"{run_dir}/{name}", mode)
                os.chmod(f"{run_dir}/{name}", mode)
                if name != "meta":
                    os.chown(f"{run_dir}/{name}", uid, gid)
        if request.program:
            # Fresh for every run: what an earlier run of the session left there (links too) is gone.
            program = f"{run_dir}/program"
            if os.path.lexists(program):
                import shutil  # only a session's later runs get here: not a start-up import

                shutil.rmtree(program)
            os.mkdir(program, 0o755)
            os.chown(program, uid, gid)
            for name, content in request.program.items():
                self._write(program, name, content)
        for path, content in request.files.items():
            located = locate(path, self.init.workdir)
            self._write(f"{run_dir}/{located.folder}", located.relative, content)
        return run_dir

    def _write(self, base: str, relative: str, content: str) -> None:
        """Write a file under `base` for the run user, refusing symlinks an earlier run of a session left."""
        uid, gid = self.init.run_uid, self.init.run_gid
        # This process is the namespace root: every directory on the way is checked, the file not followed.
        target = _inside(base, relative, resolve=True)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        with os.fdopen(os.open(target, flags, 0o644), "wb") as handle:
            handle.write(protocol.b64decode(content))
            os.fchown(handle.fileno(), uid, gid)
        parent = os.path.dirname(target)
        while parent != base:
            os.chown(parent, uid, gid, follow_symlinks=False)
            parent = os.path.dirname(parent)

    def _collect(self, dir_id: str, paths: list[str]) -> tuple[dict[str, str], list[str]]:
        run_dir = self._dir_path(dir_id)
        files: dict[str, str] = {}
        missing: list[str] = []
        for path in paths:
            try:
                located = locate(path, self.init.workdir)
                target = _inside(f"{run_dir}/{located.folder}", located.relative, resolve=True)
                fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except (OSError, ValueError):
                missing.append(path)
                continue
            with os.fdopen(fd, "rb") as handle:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    missing.append(path)
                    continue
                files[path] = protocol.b64encode(handle.read())
        return files, missing

    def _release(self, dir_id: str) -> None:
        if dir_id not in self.run_dirs:
            return
        run_dir = self._dir_path(dir_id)
        linux.umount(run_dir, MNT_DETACH)
        os.rmdir(run_dir)
        self.run_dirs.discard(dir_id)

    def _run_step(
        self, run_dir: str, step: StepRequest, cgroup_fds: list[int], binds: list[tuple[str, str]]
    ) -> StepOutcome:
        with open(f"{run_dir}/meta/stdin", "wb") as handle:
            handle.write(protocol.b64decode(step.stdin_b64))
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        status_r, status_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        plan = ChildPlan(
            run_dir=run_dir,
            workdir=self.init.workdir,
            argv=step.argv,
            inline_python=step.inline_python,
            env=step.env,
            uid=self.init.run_uid,
            gid=self.init.run_gid,
            cgroup_fds=cgroup_fds,
            stdout_fd=out_w,
            stderr_fd=err_w,
            status_fd=status_w,
            cpu_time_limit_s=step.cpu_time_limit_s,
            open_files_max=step.open_files_max,
            file_size_max_bytes=step.file_size_max_bytes,
            shadows=[*binds, *self.shadows],
        )
        data, fds = encode_plan(plan)
        plan_fd = os.memfd_create("tether-plan", os.MFD_CLOEXEC)
        started = time.perf_counter()
        try:
            os.write(plan_fd, data)
            socket.send_fds(self.forker, [b"f"], [plan_fd, *fds])
        finally:
            for fd in (plan_fd, out_w, err_w, status_w):
                os.close(fd)
        try:
            pidfd = self._receive_pidfd()
        except BaseException:
            for fd in (out_r, err_r, status_r):
                os.close(fd)
            raise
        return self._supervise(pidfd, started, step, out_r, err_r, status_r)

    def _receive_pidfd(self) -> int:
        message, fds, _, _ = socket.recv_fds(self.forker, 16, 1)
        if message != b"p" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise RuntimeError("the fork server did not start the run")
        return fds[0]

    def _supervise(
        self, pidfd: int, started: float, step: StepRequest, out_r: int, err_r: int, status_r: int
    ) -> StepOutcome:
        deadline = started + step.timeout_s
        streams = {out_r: bytearray(), err_r: bytearray()}
        truncated = {out_r: False, err_r: False}
        timed_out = output_exceeded = exited = False
        poller = select.poll()
        for fd in (out_r, err_r, pidfd):
            poller.register(fd, select.POLLIN)
        open_fds = {out_r, err_r}
        try:
            while open_fds or not exited:
                remaining = deadline - time.perf_counter()
                if remaining <= 0 and not timed_out and not exited:
                    timed_out = True
                    _kill(pidfd)
                wait_ms = 1000 if timed_out else max(remaining, 0.0) * 1000
                for fd, _ in poller.poll(wait_ms):
                    if fd == pidfd:
                        exited = True
                        poller.unregister(pidfd)
                        continue
                    chunk = os.read(fd, _READ_CHUNK)
                    if not chunk:
                        poller.unregister(fd)
                        open_fds.discard(fd)
                    else:
                        room = step.output_limit_bytes - len(streams[fd])
                        if len(chunk) <= room:
                            streams[fd] += chunk
                            continue
                        streams[fd] += chunk[: max(room, 0)]
                        truncated[fd] = True
                        if not output_exceeded:
                            output_exceeded = True
                            _kill(pidfd)
            # The status pipe is read only now: the run's setup writes at most a short message (it fits
            # the pipe's buffer) and closes its end before its program starts, so polling it would only
            # add a wake-up per run. Non-blocking: a write end left open reads as what it holds so far.
            setup_error = bytearray()
            with contextlib.suppress(BlockingIOError):
                while chunk := os.read(status_r, _READ_CHUNK):
                    setup_error += chunk
        finally:
            for fd in (out_r, err_r, status_r, pidfd):
                os.close(fd)
        reply = self.forker.recv(forkserver.EXIT_REPORT.size + 16)
        if len(reply) != forkserver.EXIT_REPORT.size:
            raise RuntimeError("the fork server did not report the run's exit")
        status, user_s, system_s = forkserver.EXIT_REPORT.unpack(reply)
        wall_ms = (time.perf_counter() - started) * 1000
        exit_code = os.waitstatus_to_exitcode(status)
        return StepOutcome(
            exit_code=exit_code if exit_code >= 0 else None,
            signal=-exit_code if exit_code < 0 else None,
            timed_out=timed_out,
            output_exceeded=output_exceeded,
            stdout_b64=protocol.b64encode(bytes(streams[out_r])),
            stderr_b64=protocol.b64encode(bytes(streams[err_r])),
            stdout_truncated=truncated[out_r],
            stderr_truncated=truncated[err_r],
            wall_ms=wall_ms,
            setup_error=setup_error.decode(errors="replace") if setup_error else None,
            cpu_ms=(user_s + system_s) * 1000,
        )


def _kill(pidfd: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)


class SymlinkEscape(ValueError):
    """A file path whose directories, once their symlinks are followed, lead out of the workdir."""


def _inside(base: str, relative: str, resolve: bool = False) -> str:
    """Resolve `relative` under `base`, refusing absolute paths and `..` escapes.

    With `resolve`, the symlinks among the target's directories are followed too (the run made them;
    the caller then opens the last component with O_NOFOLLOW): nothing runs in the run directory at
    this point, so what is checked here is what gets opened.
    """
    if relative.startswith("/") or not relative:
        raise ValueError(f"file path {relative!r} must be relative to the working directory")
    target = os.path.normpath(os.path.join(base, relative))
    if not target.startswith(base + "/"):
        raise ValueError(f"file path {relative!r} escapes the working directory")
    if resolve and not (os.path.realpath(os.path.dirname(target)) + "/").startswith(base + "/"):
        raise SymlinkEscape(f"file path {relative!r} leads out of the working directory through a symlink")
    return target


def _zygote_main(control: socket.socket, fd_channel: socket.socket, init: WorkerInit) -> None:
    linux.set_process_name("tether-zygote")
    try:
        socket.sethostname("sandbox")
        shadows = build_root(init.skeleton_dir, init.readonly_paths, init.device_nodes, init.workdir)
        # Only now: changing credentials (build_root switches to the namespace root) clears the setting.
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        if init.loopback_up:
            _bring_loopback_up()
        forker = forkserver.start(
            sys.executable,
            protocol.b64decode(init.seccomp_bpf_b64),
            init.preload_modules,
            f"{STAGING}/.rehearsal.py",
            [control, fd_channel],
        )
        zygote = Zygote(control, fd_channel, init, forker, shadows)
    except Exception:
        import traceback  # only on a failed start: it is not a start-up import

        protocol.send_frame(control, {"op": "error", "error": traceback.format_exc()})
        return
    protocol.send_frame(control, {"op": "ready", "fingerprint": fingerprint()})
    zygote.serve()


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[-2]))
    fd_channel = socket.socket(fileno=int(sys.argv[-1]))
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
    init = WorkerInit(**protocol.recv_frame(control))
    try:
        linux.unshare(WORKER_NAMESPACES)
    except OSError as error:
        protocol.send_frame(control, {"op": "error", "error": str(error)})
        sys.exit(1)
    protocol.send_frame(control, {"op": "map_ids"})
    if protocol.recv_frame(control).get("op") != "ids_mapped":
        sys.exit(1)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _zygote_main(control, fd_channel, init)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    control.close()
    fd_channel.close()
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


if __name__ == "__main__":
    main()
