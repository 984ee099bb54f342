"""`tether sandbox doctor`: what each missing primitive is blamed on, and the fix it names, wherever it runs.

The core (`doctor.diagnose`, `detect_environment`) is fed fabricated probe results, one failure at a time,
as a pod, a container or a node would produce them; the real probes run on this machine (root, every
primitive there) and in a user namespace that maps only ids 0-65535, as a hostUsers: false pod does.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tether.cli.main import app
from tether.sandbox import doctor
from tether.sandbox.doctor import Environment, Finding, Platform, Primitive, Probe, diagnose
from tether.sandbox.probes import probe_all
from tether.sandbox.worker import IdMap

from .pods import run_in_pod

REPO = Path(__file__).resolve().parents[2]
POD = Environment(Platform.KUBERNETES, gvisor=False, own_user_namespace=True, uid_map="0 833617920 65536\n")
GVISOR_POD = Environment(
    Platform.KUBERNETES, gvisor=True, own_user_namespace=False, uid_map="0 0 4294967295\n"
)
NODE = Environment(Platform.HOST, gvisor=False, own_user_namespace=False, uid_map="0 0 4294967295\n")


def _all_ok() -> list[Probe]:
    return [Probe(primitive, True, "available") for primitive in Primitive]


def _with(failure: Probe) -> list[Probe]:
    return [failure if p.primitive is failure.primitive else p for p in _all_ok()]


def _finding(findings: list[Finding], primitive: Primitive) -> Finding:
    return next(f for f in findings if f.name == primitive.value)


@pytest.mark.parametrize(
    ("env", "failure", "fix_says"),
    [
        (
            POD,
            Probe(Primitive.USER_NAMESPACE, False, "unshare: EPERM", errno.EPERM),
            ["seccompProfile", "unprivileged_userns_clone"],
        ),
        (
            NODE,
            Probe(Primitive.USER_NAMESPACE, False, "unshare: ENOSPC", errno.ENOSPC),
            ["user.max_user_namespaces"],
        ),
        (
            POD,
            Probe(Primitive.ID_MAP, False, "host ids 1000000", errno.EPERM, "unmapped"),
            ["TETHER_SANDBOX__HOST_UID_BASE", "0-65535"],
        ),
        (
            POD,
            Probe(Primitive.ID_MAP, False, "host ids 60000 and 61000", errno.EPERM),
            ["capabilities.add: [SETUID, SETGID]"],
        ),
        (
            POD,
            Probe(Primitive.PID_NAMESPACE, False, "unshare: EPERM", errno.EPERM),
            ["seccompProfile type: Unconfined"],
        ),
        (POD, Probe(Primitive.MOUNT_NAMESPACE, False, "mount: EACCES", errno.EACCES), ["appArmorProfile"]),
        (
            POD,
            Probe(Primitive.PROC, False, "mount proc: EPERM", errno.EPERM),
            ["procMount: Unmasked", "hostUsers: false"],
        ),
        (
            POD,
            Probe(Primitive.CGROUPS, False, "prepare: EROFS", errno.EROFS, "prepare"),
            ["read-only", "TETHER_SANDBOX__INSECURE=true", "privileged"],
        ),
        (
            NODE,
            Probe(Primitive.CGROUPS, False, "/ holds processes", errno.ENOENT, "internal-process"),
            ["cgroup v2", "root cgroup"],
        ),
        (
            GVISOR_POD,
            Probe(Primitive.CGROUPS, False, "stats: ENOENT", errno.ENOENT, "stats"),
            ["gVisor", "sandbox.insecure"],
        ),
        (
            NODE,
            Probe(Primitive.CGROUPS, False, "no v1 hierarchy", None, "layout"),
            ["cgroup v2 with those controllers"],
        ),
        (NODE, Probe(Primitive.SECCOMP, False, "ValueError: no libseccomp"), ["CONFIG_SECCOMP_FILTER"]),
        (POD, Probe(Primitive.ROOT, False, "euid 1000"), ["runAsUser: 0"]),
        (POD, Probe(Primitive.CAPABILITIES, False, "KILL, SETUID"), ["capabilities.add: [KILL, SETUID]"]),
    ],
    ids=lambda value: value.primitive.name if isinstance(value, Probe) else None,
)
def test_each_missing_primitive_gets_the_fix_for_where_it_runs(
    env: Environment, failure: Probe, fix_says: list[str]
) -> None:
    findings = diagnose(env, _with(failure))
    bad = [f for f in findings if not f.ok]
    assert [f.name for f in bad] == [failure.primitive.value] and bad[0].required
    for phrase in fix_says:
        assert phrase in bad[0].fix, bad[0].fix


def test_every_primitive_has_a_fix_and_the_manifests_it_names_exist() -> None:
    assert set(doctor.FIXES) == set(Primitive)
    for path in (doctor.USERNS_MANIFEST, doctor.GVISOR_MANIFEST, doctor.PRIVILEGED_MANIFEST):
        assert (REPO / path).is_file(), path
    userns = (REPO / doctor.USERNS_MANIFEST).read_text()
    for setting in (
        "procMount: Unmasked",
        "hostUsers: false",
        "seccompProfile: {type: Unconfined}",
        "TETHER_SANDBOX__INSECURE",
    ):
        assert setting in userns  # what the fixes tell a pod to set is what the manifest sets


def test_without_a_user_namespace_the_probes_inside_one_point_back_to_it() -> None:
    probes = [
        Probe(p.primitive, False, "EPERM", errno.EPERM)
        if p.primitive in (Primitive.USER_NAMESPACE, Primitive.PROC)
        else p
        for p in _all_ok()
    ]
    findings = diagnose(POD, probes)
    assert "seccompProfile" in _finding(findings, Primitive.USER_NAMESPACE).fix
    assert _finding(findings, Primitive.PROC).fix.startswith("fix the user namespace first")


def test_insecure_makes_only_cgroups_and_seccomp_optional() -> None:
    probes = [
        Probe(p.primitive, p.primitive not in (Primitive.CGROUPS, Primitive.PROC), "x", errno.EROFS)
        for p in _all_ok()
    ]
    findings = {f.name: f for f in diagnose(POD, probes, insecure=True)}
    assert not findings[Primitive.CGROUPS.value].required
    assert "sandbox.insecure is set" in findings[Primitive.CGROUPS.value].fix
    assert findings[Primitive.PROC.value].required


@pytest.mark.parametrize(
    ("environ", "proc1_cgroup", "marker", "proc_version", "kernel_log", "uid_map", "expected"),
    [
        (
            {"KUBERNETES_SERVICE_HOST": "10.0.0.1"},
            "0::/\n",
            False,
            "Linux 6.8",
            "",
            "0 833617920 65536",
            (Platform.KUBERNETES, False, True),
        ),
        (
            {},
            "12:memory:/docker/abc\n",
            False,
            "Linux 6.8",
            "",
            "0 0 4294967295",
            (Platform.CONTAINER, False, False),
        ),
        ({}, "0::/\n", True, "Linux 6.8", "", "0 0 4294967295", (Platform.CONTAINER, False, False)),
        ({}, "0::/user.slice\n", False, "Linux 6.8", "", "0 0 4294967295", (Platform.HOST, False, False)),
        (
            {"KUBERNETES_SERVICE_HOST": "10.0.0.1"},
            "",
            False,
            "Linux version 4.4.0",
            "[0.0] Starting gVisor...",
            "0 0 4294967295",
            (Platform.KUBERNETES, True, False),
        ),
    ],
    ids=["userns-pod", "docker-cgroup", "dockerenv", "host", "gvisor-dmesg"],
)
def test_the_environment_is_told_from_what_pods_runtimes_and_gvisor_leave(
    environ: dict[str, str],
    proc1_cgroup: str,
    marker: bool,
    proc_version: str,
    kernel_log: str,
    uid_map: str,
    expected: tuple[Platform, bool, bool],
) -> None:
    env = doctor.detect_environment(environ, proc1_cgroup, marker, proc_version, kernel_log, uid_map)
    assert (env.platform, env.gvisor, env.own_user_namespace) == expected


def test_ids_outside_the_namespaces_map_and_missing_capabilities_are_named() -> None:
    assert doctor.unmapped([60000, 61000, 1_000_000], "0 833617920 65536\n") == [1_000_000]
    assert doctor.unmapped([5, 70000], "0 0 10\n65536 100 10000\n") == []
    assert doctor.missing_capabilities("00000000a80425fb") == []  # a default container's set
    assert doctor.missing_capabilities("0000000000000040") == ["KILL", "SETUID"]


def test_every_real_probe_passes_on_this_machine() -> None:
    findings = diagnose(
        doctor.Environment(Platform.HOST, False, False, "0 0 4294967295"), probe_all(IdMap(1_000_000, 1000))
    )
    assert [f.name for f in findings if not f.ok] == []
    assert {f.name for f in findings} == {p.value for p in Primitive}


_ID_MAP_PROBES = """
import json
from tether.sandbox.probes import probe_id_map
from tether.sandbox.worker import IdMap
found = {base: probe_id_map(IdMap(base, 1000)) for base in (1_000_000, 60000)}
print(json.dumps({base: [p.ok, p.stage, p.detail] for base, p in found.items()}))
"""


def test_in_a_pod_sized_id_range_the_default_host_ids_are_found_unmapped_and_60000_works() -> None:
    found = json.loads(run_in_pod(_ID_MAP_PROBES))
    assert found["1000000"] == [False, "unmapped", "host ids 1000000, 1001000"]
    assert found["60000"][:2] == [True, ""]


def test_the_command_prints_each_fix_and_refuses_settings_it_cannot_probe_with() -> None:
    runner = CliRunner()
    report = runner.invoke(app, ["sandbox", "doctor", "--json"])
    assert report.exit_code == 0, report.output
    payload = json.loads(report.stdout)
    assert payload["environment"]["platform"] in {p.value for p in Platform}
    assert all(check["ok"] and check["fix"] == "" for check in payload["checks"])
    refused = runner.invoke(app, ["sandbox", "doctor"], env={"TETHER_SANDBOX__HOST_UID_BASE": "5"})
    assert refused.exit_code != 0
    assert "host_uid_base" in refused.output


# What a non-privileged container gets on top of the pod's id range: read-only cgroup mounts and a
# /proc with a file masked (as runtimes mask /proc/keys, /proc/kcore, ...), in a mount namespace of its own.
_POD_FINDINGS = """
import json
from tether.sandbox.doctor import diagnose
from tether.sandbox.probes import current_environment, probe_all
from tether.sandbox.worker import IdMap
findings = diagnose(current_environment(), probe_all(IdMap(60000, 1000)), insecure=True)
print(json.dumps({f.name: [f.fix, f.required] for f in findings if not f.ok}))
"""


def test_in_an_emulated_non_privileged_pod_the_real_probes_name_procmount_and_the_read_only_cgroups() -> None:
    missing = json.loads(run_in_pod(_POD_FINDINGS, read_only_cgroups=True, masked_proc=True))
    assert set(missing) == {Primitive.PROC.value, Primitive.CGROUPS.value}
    proc_fix, proc_required = missing[Primitive.PROC.value]
    assert "procMount: Unmasked" in proc_fix and proc_required
    cgroup_fix, cgroup_required = missing[Primitive.CGROUPS.value]
    assert "read-only" in cgroup_fix and not cgroup_required  # insecure: the pod runs without them
