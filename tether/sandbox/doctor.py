"""`tether sandbox doctor`, the pure core: probe results and the environment in, findings with fixes out.

The probes themselves (each in a throwaway child process) live in `probes.py`; this module only
decides, from what they found and from where the process runs (a node, a container, a Kubernetes pod,
gVisor), what is missing and which setting fixes it: a `securityContext` field of the manifests in
deploy/k8s for a pod, a sysctl or a tether setting elsewhere. It reads no file and starts nothing.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

USERNS_MANIFEST = "deploy/k8s/userns/deployment.yaml"
GVISOR_MANIFEST = "deploy/k8s/gvisor/deployment.yaml"
PRIVILEGED_MANIFEST = "deploy/k8s/privileged/deployment.yaml"
NEEDED_CAPABILITIES = {"KILL": 5, "SETGID": 6, "SETUID": 7}  # name -> bit in /proc/self/status CapEff
POD_ID_RANGE = 65536  # ids a hostUsers: false pod's user namespace maps by default (0-65535)


class Primitive(Enum):
    USER_NAMESPACE = "user namespace"
    ID_MAP = "uid/gid map"
    PID_NAMESPACE = "pid namespace"
    MOUNT_NAMESPACE = "mount namespace (tmpfs, read-only bind)"
    NETWORK_NAMESPACE = "network namespace"
    IPC_NAMESPACE = "ipc namespace"
    UTS_NAMESPACE = "uts namespace"
    PROC = "fresh /proc"
    CGROUPS = "cgroups (memory, pids, cpu)"
    SECCOMP = "seccomp filter"
    ROOT = "running as root"
    CAPABILITIES = "capabilities"


# What a failure of each leaves the sandbox without when it runs anyway (--insecure): only these two
# are optional, every other primitive is what the sandbox is made of.
OPTIONAL_WITH_INSECURE = frozenset({Primitive.CGROUPS, Primitive.SECCOMP})


class Platform(Enum):
    HOST = "host"
    CONTAINER = "container"
    KUBERNETES = "kubernetes pod"


@dataclass(frozen=True, slots=True)
class Probe:
    """What one probe found: `errno` and `stage` (which step failed) when it failed on a system call."""

    primitive: Primitive
    ok: bool
    detail: str
    errno: int | None = None
    stage: str = ""


@dataclass(frozen=True, slots=True)
class Environment:
    platform: Platform
    gvisor: bool
    own_user_namespace: bool  # this process's root is not the node's (a hostUsers: false pod, rootless)
    uid_map: str  # /proc/self/uid_map, one "inside outside count" line per range

    @property
    def in_pod(self) -> bool:
        return self.platform is Platform.KUBERNETES

    def describe(self) -> str:
        parts = [self.platform.value]
        if self.gvisor:
            parts.append("on gVisor")
        if self.own_user_namespace:
            parts.append(f"in its own user namespace (uid_map {' / '.join(_map_lines(self.uid_map))})")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class Finding:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


_CONTAINER_CGROUP_MARKERS = ("kubepods", "docker", "containerd", "crio", "libpod", "lxc")


def _map_lines(uid_map: str) -> list[str]:
    return [" ".join(line.split()) for line in uid_map.strip().splitlines() if line.strip()]


def _inside_ranges(id_map: str) -> list[tuple[int, int]]:
    """The (first, count) ranges of ids that exist in this namespace, from its /proc/self/uid_map."""
    ranges = []
    for line in _map_lines(id_map):
        first, _, count = (int(field) for field in line.split())
        ranges.append((first, count))
    return ranges


def unmapped(ids: list[int], id_map: str) -> list[int]:
    """Ids that do not exist in this namespace (a worker's map may only name ones that do)."""
    ranges = _inside_ranges(id_map)
    return [i for i in ids if not any(first <= i < first + count for first, count in ranges)]


def missing_capabilities(cap_eff_hex: str) -> list[str]:
    effective = int(cap_eff_hex, 16)
    return [name for name, bit in sorted(NEEDED_CAPABILITIES.items()) if not effective >> bit & 1]


def detect_environment(
    environ: Mapping[str, str],
    proc1_cgroup: str,
    container_marker: bool,
    proc_version: str,
    kernel_log: str,
    uid_map: str,
) -> Environment:
    """Where this process runs, from what a pod, a container runtime and gVisor each leave behind."""
    if "KUBERNETES_SERVICE_HOST" in environ:
        platform = Platform.KUBERNETES
    elif container_marker or any(marker in proc1_cgroup for marker in _CONTAINER_CGROUP_MARKERS):
        platform = Platform.CONTAINER
    else:
        platform = Platform.HOST
    gvisor = "gVisor" in proc_version or "gVisor" in kernel_log
    identity = _map_lines(uid_map) == ["0 0 4294967295"]
    return Environment(platform, gvisor, own_user_namespace=not identity, uid_map=uid_map)


def _errno_name(probe: Probe) -> str:
    return errno.errorcode.get(probe.errno or 0, f"errno {probe.errno}")


def _fix_user_namespace(env: Environment, probe: Probe) -> str:
    if probe.errno == errno.ENOSPC:
        return (
            "the node allows no more user namespaces: raise user.max_user_namespaces (sysctl), e.g. to 15000"
        )
    node = (
        "the node must allow unprivileged user namespaces: kernel.unprivileged_userns_clone=1 "
        "(Debian/Ubuntu kernels), kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu >= 23.10), "
        "user.max_user_namespaces > 0"
    )
    if env.in_pod:
        return (
            f"unshare(CLONE_NEWUSER) failed with {_errno_name(probe)}: the pod's seccomp or AppArmor profile "
            "refuses it (securityContext.seccompProfile and appArmorProfile type: Unconfined, as "
            f"{USERNS_MANIFEST} sets; the runtime's default seccomp profile allows it only with "
            f"CAP_SYS_ADMIN), or {node}"
        )
    return f"unshare(CLONE_NEWUSER) failed with {_errno_name(probe)}: {node}"


def _fix_id_map(env: Environment, probe: Probe) -> str:
    if probe.stage != "unmapped":
        where = (
            "securityContext.capabilities.add: [SETUID, SETGID]"
            if env.in_pod
            else "root (CAP_SETUID, CAP_SETGID)"
        )
        return (
            f"writing a worker's two-line uid/gid map failed with {_errno_name(probe)}; it needs "
            f"CAP_SETUID and CAP_SETGID: {where}"
        )
    ranges = ", ".join(f"{first}-{first + count - 1}" for first, count in _inside_ranges(env.uid_map))
    return (
        f"the worker's ids ({probe.detail}) are not mapped in this user namespace, which maps only "
        f"{ranges}: set sandbox.host_uid_base (TETHER_SANDBOX__HOST_UID_BASE) so that host_uid_base + 1000 "
        f"lies in that range (a hostUsers: false pod maps 0-{POD_ID_RANGE - 1}; {USERNS_MANIFEST} uses "
        "60000), or give pods a larger id range in the kubelet's configuration"
    )


def _fix_namespace(env: Environment, probe: Probe) -> str:
    if env.in_pod:
        return (
            f"unshare failed with {_errno_name(probe)} although it comes with a new user namespace: the "
            "pod's seccomp profile refuses namespace flags (securityContext.seccompProfile type: "
            f"Unconfined, as {USERNS_MANIFEST} sets)"
        )
    return f"unshare failed with {_errno_name(probe)}: a seccomp or LSM profile of this process refuses it"


def _fix_mount(env: Environment, probe: Probe) -> str:
    profile = (
        "securityContext.appArmorProfile and seccompProfile type: Unconfined" if env.in_pod else "profiles"
    )
    return (
        f"mounting inside a new user and mount namespace failed with {_errno_name(probe)}: the AppArmor "
        f"or seccomp {profile} must allow mount"
    )


def _fix_proc(env: Environment, probe: Probe) -> str:
    why = (
        "a user namespace may mount a new /proc only while this one is fully visible, and the container "
        "runtime masks parts of it (/proc/kcore, /proc/sys, ...)"
    )
    if env.in_pod:
        return (
            f"{why}: set securityContext.procMount: Unmasked (it needs hostUsers: false), as "
            f"{USERNS_MANIFEST} does"
        )
    if env.platform is Platform.CONTAINER:
        return (
            f"{why}: run the container with an unmasked /proc (docker: --security-opt systempaths=unconfined)"
        )
    return (
        f"mounting a fresh /proc failed with {_errno_name(probe)}: something is mounted over parts of /proc"
    )


def _fix_cgroups(env: Environment, probe: Probe) -> str:
    degraded = (
        "or run without per-run cgroups, sandbox.insecure = true (TETHER_SANDBOX__INSECURE=true, as "
        f"{USERNS_MANIFEST} and {GVISOR_MANIFEST} do): the pod's own limits then bound all runs "
        "together, and each run keeps its rlimits (CPU time, file size, open files) and its time and "
        "output limits"
    )
    if env.gvisor and probe.stage == "stats":
        return (
            "gVisor's cgroupfs accepts limits but neither enforces memory limits nor reports peak memory: "
            f"run with sandbox.insecure = true, as {GVISOR_MANIFEST} does; the node still enforces the "
            "pod's memory limit around the whole gVisor sandbox"
        )
    if probe.stage == "internal-process":
        return (
            "cgroup v2 lets no group but the root both hold processes and give controllers to its children, "
            "and tether creates each run's group under its own (OWN/tether): per-run cgroups on cgroup v2 "
            f"work today only for a server in the root cgroup, {degraded}"
        )
    if probe.errno in (errno.EROFS, errno.EACCES, errno.EPERM) and env.platform is not Platform.HOST:
        return (
            "the container's /sys/fs/cgroup is read-only or not its own (Kubernetes mounts it read-only in "
            "every non-privileged container): per-run cgroups need the privileged fallback "
            f"({PRIVILEGED_MANIFEST}), {degraded}"
        )
    if probe.stage == "layout":
        return (
            "mount cgroup v1 memory, pids and cpu hierarchies, or cgroup v2 with those controllers "
            f"delegated, {degraded}"
        )
    return f"the cgroup tree must be writable by this user (root), {degraded}"


def _fix_seccomp(env: Environment, probe: Probe) -> str:
    return "the kernel must support seccomp filters (CONFIG_SECCOMP_FILTER) and libseccomp must be installed"


def _fix_root(env: Environment, probe: Probe) -> str:
    if env.in_pod:
        return (
            "securityContext.runAsUser: 0 (with hostUsers: false that is root of the pod's user "
            "namespace only)"
        )
    return "run the sandbox server as root (uid/gid maps and cgroups need it)"


def _fix_capabilities(env: Environment, probe: Probe) -> str:
    where = (
        f"securityContext.capabilities.add: [{probe.detail}]" if env.in_pod else "a root process with them"
    )
    return f"the server needs {probe.detail} (maps the workers' ids, stops them): {where}"


FIXES: dict[Primitive, Callable[[Environment, Probe], str]] = {
    Primitive.USER_NAMESPACE: _fix_user_namespace,
    Primitive.ID_MAP: _fix_id_map,
    Primitive.PID_NAMESPACE: _fix_namespace,
    Primitive.MOUNT_NAMESPACE: _fix_mount,
    Primitive.NETWORK_NAMESPACE: _fix_namespace,
    Primitive.IPC_NAMESPACE: _fix_namespace,
    Primitive.UTS_NAMESPACE: _fix_namespace,
    Primitive.PROC: _fix_proc,
    Primitive.CGROUPS: _fix_cgroups,
    Primitive.SECCOMP: _fix_seccomp,
    Primitive.ROOT: _fix_root,
    Primitive.CAPABILITIES: _fix_capabilities,
}
_DEPENDS_ON_USER_NAMESPACE = frozenset(
    {
        Primitive.ID_MAP,
        Primitive.PID_NAMESPACE,
        Primitive.MOUNT_NAMESPACE,
        Primitive.NETWORK_NAMESPACE,
        Primitive.IPC_NAMESPACE,
        Primitive.UTS_NAMESPACE,
        Primitive.PROC,
    }
)


def diagnose(env: Environment, probes: list[Probe], insecure: bool = False) -> list[Finding]:
    """One finding per probe; a failure carries the fix. With `insecure`, cgroups and seccomp are optional."""
    user_namespace_ok = all(p.ok for p in probes if p.primitive is Primitive.USER_NAMESPACE)
    findings = []
    for probe in probes:
        required = not (insecure and probe.primitive in OPTIONAL_WITH_INSECURE)
        if probe.ok:
            findings.append(Finding(probe.primitive.value, True, probe.detail, required=required))
            continue
        if not user_namespace_ok and probe.primitive in _DEPENDS_ON_USER_NAMESPACE:
            fix = "fix the user namespace first: this probe runs inside one"
        else:
            fix = FIXES[probe.primitive](env, probe)
        if not required:
            fix += " (not required now: sandbox.insecure is set, so the sandbox runs without it)"
        findings.append(Finding(probe.primitive.value, False, probe.detail, fix, required))
    return findings
