"""The manifests under deploy/k8s: valid for a pinned Kubernetes, and safe as a reviewer reads them.

Every object is validated by kubernetes-validate (strict: unknown fields are errors) against
KUBERNETES_VERSION; KEDA's ScaledObject, which it does not know, against the openAPI schema of KEDA's own
CRD, vendored in deploy/k8s/schemas with its source. Then the facts the isolation rests on: only the
fallback is privileged, the userns variant has its own user namespace, the gVisor one its RuntimeClass,
no pod sees a service account token, every container has limits, and both Services select the pods.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tether.config import SandboxSettings
from tether.sandbox.pool import PoolConfig

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33.0"  # the oldest release with user namespaces on by default (beta)
VARIANTS = ("userns", "gvisor", "privileged")
KEDA_SCHEMA = K8S / "schemas" / "keda-scaledobject-v1alpha1.json"


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def _objects() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in _manifest_files() for doc in _documents(path)]


def _by_kind(kind: str) -> dict[str, dict[str, Any]]:
    """Objects of one kind keyed by the folder they live in (userns, gvisor, base, ...)."""
    return {path.parent.name: doc for path, doc in _objects() if doc["kind"] == kind}


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD schema that refuses unknown fields, as `kubectl apply --validate=strict` does."""
    schema = copy.deepcopy(schema)

    def walk(node: dict[str, Any]) -> None:
        if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node.setdefault("additionalProperties", False)
        for child in node.get("properties", {}).values():
            walk(child)
        if isinstance(node.get("items"), dict):
            walk(node["items"])
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"])

    walk(schema)
    schema["properties"]["metadata"] = {"type": "object", "required": ["name"]}
    return schema


def _validate_scaled_object(doc: dict[str, Any]) -> None:
    vendored = json.loads(KEDA_SCHEMA.read_text())
    assert doc["apiVersion"] == f"{vendored['group']}/{vendored['version']}"
    jsonschema.validate(doc, _strict(vendored["openAPIV3Schema"]))


def _validate(doc: dict[str, Any]) -> None:
    if doc["kind"] == "ScaledObject":
        _validate_scaled_object(doc)
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_validates_against_its_schema(path: Path) -> None:
    docs = _documents(path)
    assert docs, f"{path} holds no object"
    for doc in docs:
        _validate(doc)


@pytest.mark.parametrize(
    ("kind", "mutate"),
    [
        ("Deployment", lambda d: d["spec"]["template"]["spec"].update(hostUser=False)),  # typo of hostUsers
        (
            "Deployment",
            lambda d: d["spec"]["template"]["spec"]["containers"][0]["securityContext"].update(
                runAsUser="root"
            ),
        ),
        ("ScaledObject", lambda d: d["spec"].update(minReplicas=2)),  # the HPA's name, not KEDA's
        (
            "ScaledObject",
            lambda d: d["spec"]["triggers"][0]["metadata"].update(threshold=4),
        ),  # must be a string
    ],
)
def test_a_wrong_field_fails_validation(kind: str, mutate: Any) -> None:
    doc = copy.deepcopy(next(d for _, d in _objects() if d["kind"] == kind))
    mutate(doc)
    with pytest.raises(jsonschema.ValidationError):
        _validate(doc)


def test_every_kustomization_lists_files_that_exist_and_every_manifest_is_reachable() -> None:
    listed: set[Path] = set()
    for kustomization in K8S.rglob("kustomization.yaml"):
        for resource in yaml.safe_load(kustomization.read_text())["resources"]:
            target = (kustomization.parent / resource).resolve()
            assert target.exists(), f"{kustomization} lists {resource}, which does not exist"
            listed.add(target)
    applied_alone = {p.resolve() for p in (K8S / "autoscaling").glob("*.yaml")}
    for path in _manifest_files():
        assert path.resolve() in listed | applied_alone, f"{path} is in no kustomization"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (kustomize build)")
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_builds_with_kustomize_into_valid_objects(variant: str) -> None:
    built = subprocess.run(
        ["kubectl", "kustomize", str(K8S / variant)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    docs = [d for d in yaml.safe_load_all(built) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("Deployment") == 1 and kinds.count("Service") == 2
    for doc in docs:
        _validate(doc)


def test_only_the_fallback_is_privileged() -> None:
    for path, doc in _objects():
        text = yaml.safe_dump(doc)
        if path.parent.name == "privileged":
            assert "privileged: true" in text
        else:
            assert "privileged: true" not in text, f"{path} runs a privileged container"


def _pod(variant: str) -> dict[str, Any]:
    pod: dict[str, Any] = _by_kind("Deployment")[variant]["spec"]["template"]["spec"]
    return pod


def test_the_userns_variant_has_its_own_user_namespace_and_only_the_capabilities_it_needs() -> None:
    pod = _pod("userns")
    assert pod["hostUsers"] is False
    context = pod["containers"][0]["securityContext"]
    assert context["procMount"] == "Unmasked"  # a user namespace mounts /proc only while it is unmasked
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["SETUID", "SETGID", "KILL"]}
    assert pod["securityContext"]["seccompProfile"]["type"] == "Unconfined"  # pivot_root: see its header


def test_the_userns_variant_maps_the_runs_into_the_pods_own_id_range() -> None:
    """A hostUsers: false pod maps ids 0-65535 only; the worker's map must name ids inside them."""
    env = {e["name"]: e.get("value") for e in _pod("userns")["containers"][0]["env"]}
    base = int(env["TETHER_SANDBOX__HOST_UID_BASE"])
    assert base + PoolConfig().run_uid < 65536


def test_the_gvisor_variant_names_a_runtime_class_that_is_shipped() -> None:
    (runtime_class,) = _by_kind("RuntimeClass").values()
    assert _pod("gvisor")["runtimeClassName"] == runtime_class["metadata"]["name"]
    assert runtime_class["handler"] == "runsc"
    assert "hostUsers" not in _pod("gvisor")


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_pod_lacks_credentials_and_has_limits(variant: str) -> None:
    pod = _pod(variant)
    assert pod["automountServiceAccountToken"] is False
    for container in pod["containers"]:
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        assert limits["cpu"] and limits["memory"] and requests == limits


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_pod_names_its_instance_and_sets_only_real_settings(variant: str) -> None:
    env = {e["name"]: e for e in _pod(variant)["containers"][0]["env"]}
    assert env["MY_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    for name in env:
        if name.startswith("TETHER_SANDBOX__"):
            model: Any = SandboxSettings
            for part in name.removeprefix("TETHER_SANDBOX__").lower().split("__"):
                assert part in model.model_fields, f"{variant}: {name} sets no sandbox setting"
                model = model.model_fields[part].annotation


@pytest.mark.parametrize("variant", VARIANTS)
def test_both_services_select_the_pods_of_every_variant(variant: str) -> None:
    deployment = _by_kind("Deployment")[variant]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    services = {d["metadata"]["name"]: d for _, d in _objects() if d["kind"] == "Service"}
    assert services["tether-sandbox-headless"]["spec"]["clusterIP"] == "None"
    assert "clusterIP" not in services["tether-sandbox"]["spec"]
    for service in services.values():
        assert service["spec"]["selector"].items() <= labels.items()
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_both_autoscalers_scale_the_sandbox_deployment_on_its_queue() -> None:
    deployments = {d["metadata"]["name"] for d in _by_kind("Deployment").values()}
    hpa = _by_kind("HorizontalPodAutoscaler")["autoscaling"]
    keda = _by_kind("ScaledObject")["autoscaling"]
    for target in (hpa["spec"]["scaleTargetRef"], keda["spec"]["scaleTargetRef"]):
        assert target["kind"] == "Deployment" and target["name"] in deployments
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "tether_sandbox_queue_depth"
    queries = [t["metadata"]["query"] for t in keda["spec"]["triggers"]]
    assert any("tether_sandbox_queue_depth" in q for q in queries)
    assert any("tether_sandbox_busy_slots" in q and "tether_sandbox_slots" in q for q in queries)
