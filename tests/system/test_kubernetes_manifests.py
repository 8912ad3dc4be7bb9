"""deploy/kubernetes/, checked offline: no cluster, no network.

Every object is validated against Kubernetes' own OpenAPI schemas, strictly (an unknown or
misspelt field fails), for pinned Kubernetes versions, with kubernetes-validate, which bundles
the schemas (a dev dependency). Skipped when it is not installed, unless
WEIGHTSERVER_REQUIRE_KUBERNETES_VALIDATE=1 (CI), which turns that into a failure.

Then the facts no schema knows: every server's arguments are accepted by the real `weightserver
serve` parser and make a valid ServerConfig; the relays follow the primary's Service on the port
that reaches its gRPC port; Services publish the bulk port under the number the server names;
probes ask the gRPC health service on the gRPC port; the claim is mounted where --data-dir
points; a relay's --shm-dir is the node's /dev/shm, mounted at the same path in its collectors;
the demo's containers set only variables they read.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from demo import config as demo_config
from weightserver.cli import build_parser, server_config
from weightserver.config import ServerConfig

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "deploy" / "kubernetes"
# The oldest version the manifests need (native gRPC probes are GA in 1.27) and a recent one.
KUBERNETES_VERSIONS = ("1.27.0", "1.33.0")
IMAGE = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())["x-image"]["image"]
WORKLOADS = ("StatefulSet", "DaemonSet", "Deployment", "Job")
_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")
_SCALE = {"m": 1e-3, None: 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12} | {
    unit: 1024**power for power, unit in enumerate(("Ki", "Mi", "Gi", "Ti"), start=1)
}


def kubernetes_validate() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        message = "kubernetes-validate is not installed: pip install -e '.[dev]'"
        if os.environ.get("WEIGHTSERVER_REQUIRE_KUBERNETES_VALIDATE") == "1":  # CI: never pass by skipping
            pytest.fail(f"{message} (WEIGHTSERVER_REQUIRE_KUBERNETES_VALIDATE=1)")
        pytest.skip(message)
    return kubernetes_validate


def manifest_files() -> list[Path]:
    return sorted(p for p in MANIFESTS.glob("*.yaml") if p.name != "kustomization.yaml")


def objects() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, obj) for path in manifest_files() for obj in yaml.safe_load_all(path.read_text()) if obj]


def named(kind: str) -> dict[str, dict[str, Any]]:
    return {obj["metadata"]["name"]: obj for _, obj in objects() if obj["kind"] == kind}


def one(kind: str) -> dict[str, Any]:
    [obj] = named(kind).values()
    return obj


def identities(items: Iterable[dict[str, Any]]) -> list[tuple[str, str]]:
    return sorted((obj["kind"], obj["metadata"]["name"]) for obj in items)


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def containers() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) for every container of every workload."""
    for _, obj in objects():
        if obj["kind"] in WORKLOADS:
            for container in pod_spec(obj).get("initContainers", []) + pod_spec(obj)["containers"]:
                yield obj, container


def full_command(container: dict[str, Any]) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def serve_options(container: dict[str, Any]) -> ServerConfig:
    """The container's `weightserver serve ...`, parsed by the real parser, as its ServerConfig."""
    command = full_command(container)
    assert command[:2] == ["weightserver", "serve"], command
    return server_config(build_parser().parse_args(command[1:]))


def server(workload: dict[str, Any]) -> tuple[dict[str, Any], ServerConfig]:
    [container] = [c for c in pod_spec(workload)["containers"] if full_command(c)[:2] == ["weightserver", "serve"]]
    return container, serve_options(container)


def environment(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item.get("value") for item in container.get("env", [])}


def quantity(text: str | int) -> float:
    match = _QUANTITY.match(str(text))
    assert match, f"not a quantity: {text!r}"
    return float(match.group(1)) * _SCALE[match.group(2)]


def container_port(workload: dict[str, Any], target: int | str) -> int:
    """The container port a Service's targetPort names (a number, or a port's name)."""
    if isinstance(target, int):
        return target
    ports = {p["name"]: p["containerPort"] for c in pod_spec(workload)["containers"] for p in c.get("ports", [])}
    assert target in ports, f"targetPort {target!r} names no port of {workload['metadata']['name']}"
    return ports[target]


def service_for(workload: dict[str, Any], headless: bool = False) -> dict[str, Any]:
    """The (headless or not) Service whose selector picks the workload's pods."""
    labels = workload["spec"]["template"]["metadata"]["labels"]
    found = [
        s
        for s in named("Service").values()
        if s["spec"]["selector"].items() <= labels.items() and (s["spec"].get("clusterIP") == "None") == headless
    ]
    assert len(found) == 1, f"{len(found)} Services select {workload['metadata']['name']}"
    return found[0]


def service_port(service: dict[str, Any], workload: dict[str, Any], port: int) -> dict[str, Any]:
    """The Service's entry that reaches the workload's container port `port`."""
    found = [p for p in service["spec"]["ports"] if container_port(workload, p.get("targetPort", p["port"])) == port]
    assert len(found) == 1, f"Service {service['metadata']['name']} reaches port {port} {len(found)} times"
    return found[0]


# ------------------------------------------------------------------------- schemas
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schema(version: str):
    validator = kubernetes_validate()
    errors = []
    for path, obj in objects():
        try:
            validator.validate(obj, version, strict=True)
        except validator.ValidationError as exc:
            where = ".".join(map(str, exc.path))
            errors.append(f"{path.name}: {obj['kind']}/{obj['metadata']['name']}: {where}: {exc.message}")
    assert not errors, "\n".join(errors)


def test_a_misspelt_field_fails_strict_validation():
    """The check above can fail: a field the schema does not know is an error."""
    validator = kubernetes_validate()
    relay = yaml.safe_load_all((MANIFESTS / "relay.yaml").read_text())
    daemonset = next(obj for obj in relay if obj["kind"] == "DaemonSet")
    daemonset["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grcp"] = {"port": 50051}
    with pytest.raises(validator.ValidationError, match="grcp"):
        validator.validate(daemonset, KUBERNETES_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest_and_the_compose_image():
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in manifest_files()]
    [namespace] = named("Namespace")
    assert kustomization["namespace"] == namespace
    assert [i["name"] for i in kustomization["images"]] == [IMAGE.rsplit(":", 1)[0]]
    for workload, container in containers():
        assert container["image"] == IMAGE, f"{workload['metadata']['name']}: {container['image']} is not {IMAGE}"
        assert container["imagePullPolicy"] == "IfNotPresent"  # an image loaded into the nodes works too
    for _, obj in objects():  # kustomize sets the namespace; `kubectl apply -n` can too
        assert "namespace" not in obj["metadata"], f"{obj['kind']}/{obj['metadata']['name']}"


def test_kubectl_kustomize_renders_every_object_into_the_namespace():
    """`kubectl kustomize` (offline, client-side) where kubectl is installed; CI has none, the
    schema checks above cover the files themselves."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run([kubectl, "kustomize", str(MANIFESTS)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rendered = [obj for obj in yaml.safe_load_all(result.stdout) if obj]
    assert identities(rendered) == identities(obj for _, obj in objects())
    namespace = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())["namespace"]
    assert all(o["metadata"].get("namespace") == namespace for o in rendered if o["kind"] != "Namespace")


# --------------------------------------------------------------- the servers' flags
def test_every_server_command_is_accepted_by_weightserver_serve():
    servers = [(w, c) for w, c in containers() if full_command(c)[:2] == ["weightserver", "serve"]]
    assert {w["kind"] for w, _ in servers} == {"StatefulSet", "DaemonSet"}
    for workload, container in servers:
        options = serve_options(container)  # argparse exits (SystemExit) on a flag it does not know
        assert options.host == "0.0.0.0", workload["metadata"]["name"]
        assert options.bulk_port and options.metrics_port, "fixed ports, so that Services can publish them"
        declared = {p["containerPort"] for p in container["ports"]}
        assert {options.port, options.bulk_port, options.metrics_port} == declared, workload["metadata"]["name"]


def test_the_parser_check_can_fail():
    container = {"command": ["weightserver", "serve"], "args": ["--upstream=primary:50051", "--modles=policy"]}
    with pytest.raises(SystemExit):
        serve_options(container)
    container["args"] = ["--models=policy"]  # parses, but ServerConfig refuses --models without --upstream
    with pytest.raises(ValueError, match="upstream"):
        serve_options(container)


def test_primary_is_one_statefulset_with_its_data_dir_on_a_claim():
    primary = one("StatefulSet")
    assert primary["spec"]["replicas"] == 1  # a second primary would number versions on its own
    container, options = server(primary)
    assert options.upstream is None
    [claim] = primary["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert options.data_dir is not None and mounts[claim["metadata"]["name"]] == str(options.data_dir)
    # the governing Service is headless and selects the pods
    governing = service_for(primary, headless=True)
    assert primary["spec"]["serviceName"] == governing["metadata"]["name"]
    security = pod_spec(primary)["securityContext"]
    assert security["runAsUser"] == security["fsGroup"] == 10001  # the image's user can write the claim


def test_services_publish_the_ports_the_servers_name():
    """A client dials a Service's gRPC port; the server then names its bulk port by number,
    dialled at the same host, so the Service must publish the bulk port under that number."""
    for workload in (one("StatefulSet"), one("DaemonSet")):
        _, options = server(workload)
        service = service_for(workload)
        service_port(service, workload, options.port)
        assert service_port(service, workload, options.bulk_port)["port"] == options.bulk_port
        service_port(service, workload, options.metrics_port)


def test_relays_follow_the_primary_service():
    primary, relays = one("StatefulSet"), one("DaemonSet")
    _, primary_options = server(primary)
    _, options = server(relays)
    service = service_for(primary)
    port = service_port(service, primary, primary_options.port)["port"]
    assert options.upstream == f"{service['metadata']['name']}:{port}"


def test_a_relays_upstream_token_comes_from_a_secret_under_the_variable_serve_reads():
    from weightserver.cli import UPSTREAM_TOKEN_ENV

    container, _ = server(one("DaemonSet"))
    [item] = [item for item in container["env"] if item["name"] == UPSTREAM_TOKEN_ENV]
    assert "value" not in item  # never written in the manifest
    reference = item["valueFrom"]["secretKeyRef"]
    assert reference["optional"] is True  # the primary here requires no token: the relay starts without the Secret
    primary, _ = server(one("StatefulSet"))
    assert UPSTREAM_TOKEN_ENV not in environment(primary)  # a primary's would be ignored


def test_collectors_reach_the_relay_on_their_own_node():
    relays = one("DaemonSet")
    _, options = server(relays)
    service = service_for(relays)
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    address = f"{service['metadata']['name']}:{service_port(service, relays, options.port)['port']}"
    [container] = pod_spec(one("Deployment"))["containers"]
    assert environment(container)["WEIGHTSERVER_ADDRESS"] == address


def test_probes_ask_the_grpc_health_service_on_the_grpc_port():
    for workload in (one("StatefulSet"), one("DaemonSet")):
        container, options = server(workload)
        name = workload["metadata"]["name"]
        assert {"livenessProbe", "readinessProbe"} <= container.keys(), name
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            if kind not in container:
                continue
            probe = container[kind]
            assert not {"exec", "httpGet", "tcpSocket"} & probe.keys(), (name, kind)
            assert probe["grpc"]["port"] == options.port, (name, kind)
            # "" (the whole server): SERVING while it serves, on a relay also while its upstream
            # is away. "weightserver.relay" (is the upstream answering?) must never restart or
            # unready a relay: docs/deployment/kubernetes.md, "What the probes check".
            assert probe["grpc"].get("service", "") == "", (name, kind)


# ---------------------------------------------------------------- memory and sharing
def test_relay_shares_the_nodes_shm_with_the_collectors_at_the_same_path():
    """The relay hands out file paths, so a collector must see its --shm-dir at the same path."""
    relays, collectors = one("DaemonSet"), one("Deployment")
    container, options = server(relays)
    volumes = {v["name"]: v for v in pod_spec(relays)["volumes"]}
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == str(options.shm_dir)]
    host_path = volumes[mount["name"]]["hostPath"]
    assert host_path == {"path": "/dev/shm", "type": "Directory"}  # a tmpfs on every node, mode 1777
    [collector] = pod_spec(collectors)["containers"]
    collector_volumes = {v["name"]: v for v in pod_spec(collectors)["volumes"]}
    shared = [m for m in collector["volumeMounts"] if collector_volumes[m["name"]].get("hostPath") == host_path]
    assert [(m["mountPath"], m.get("readOnly")) for m in shared] == [(str(options.shm_dir), True)]


def test_primary_shm_is_a_sized_memory_volume_within_its_memory_limit():
    primary = one("StatefulSet")
    container, options = server(primary)
    volumes = {v["name"]: v for v in pod_spec(primary)["volumes"]}
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == str(options.shm_dir)]
    shm = volumes[mount["name"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    # (keep + one upload in flight) x the 64 MiB model the manifests are sized for, at least
    assert quantity(shm["sizeLimit"]) >= (options.keep + 1) * 64 * 2**20
    # a memory-backed emptyDir counts against the container's memory limit
    assert quantity(shm["sizeLimit"]) < quantity(container["resources"]["limits"]["memory"])


def test_every_container_has_requests_and_limits():
    for workload, container in containers():
        resources = container["resources"]
        for resource in ("cpu", "memory"):
            request, limit = resources["requests"][resource], resources["limits"][resource]
            assert quantity(request) <= quantity(limit), (workload["metadata"]["name"], resource)
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]
        assert pod_spec(workload)["securityContext"]["runAsNonRoot"] is True


# ------------------------------------------------------------------------ the demo
def test_demo_trainer_and_collectors_set_only_what_they_read_and_agree():
    trainer, collectors = one("Job"), one("Deployment")
    [trainer_container] = pod_spec(trainer)["containers"]
    [collector_container] = pod_spec(collectors)["containers"]
    roles = {
        "demo.trainer": (trainer_container, demo_config.TRAINER_OPTIONS),
        "demo.collector": (collector_container, demo_config.COLLECTOR_OPTIONS),
    }
    for module, (container, names) in roles.items():
        assert full_command(container) == ["python", "-m", module]
        readable = {demo_config.OPTIONS[name].env: demo_config.OPTIONS[name] for name in names}
        for item in container["env"]:
            assert item["name"] in readable, f"{module} does not read ${item['name']}"
            if "value" in item:
                readable[item["name"]].type(item["value"])  # a value the demo accepts
    trainer_env, collector_env = environment(trainer_container), environment(collector_container)
    assert int(trainer_env["DEMO_COLLECTORS"]) == collectors["spec"]["replicas"]
    primary = one("StatefulSet")
    _, options = server(primary)
    service = service_for(primary)
    assert trainer_env["WEIGHTSERVER_ADDRESS"] == f"{service['metadata']['name']}:{options.port}"
    shared = ("DEMO_MODEL", "DEMO_SPOOL_DIR", "DEMO_SECONDS", "DEMO_SEED")
    assert {k: trainer_env[k] for k in shared} == {k: collector_env[k] for k in shared}
    # the spool is one ReadWriteMany claim, mounted at DEMO_SPOOL_DIR in the trainer and every collector
    claims = named("PersistentVolumeClaim")
    for workload, container in ((trainer, trainer_container), (collectors, collector_container)):
        volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
        [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == trainer_env["DEMO_SPOOL_DIR"]]
        claim = claims[volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]]
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
