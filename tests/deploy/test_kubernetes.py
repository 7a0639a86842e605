"""The Kubernetes manifests under deploy/k8s: valid against Kubernetes' own schemas offline
(kubernetes-validate, strict: an unknown field fails), and their structure: probes through
grpc.health.v1 and /health, the GPU request, Services that select pods and name their ports, the
model volume and the shared-memory volume, the env the processes read, and every command taking its
flags (with the ConfigMap's values put in)."""

import copy
import re
from pathlib import Path

import pytest

from expert_server.config import parse_layers
from tests.deploy.test_compose import accepts

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
VERSION = "1.33"
FILES = sorted(str(p.relative_to(K8S)) for p in K8S.rglob("*.yaml"))
WORKLOADS = ("Deployment", "StatefulSet")


def load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def one(name: str, kind: str) -> dict:
    (doc,) = [d for d in load(name) if d["kind"] == kind]
    return doc


def workloads():
    for name in FILES:
        for doc in load(name):
            if doc["kind"] in WORKLOADS:
                yield name, doc


def containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"]


CONFIG = one("config.yaml", "ConfigMap")["data"]


def expanded(container: dict, pod_index: int = 0) -> list[str]:
    """command + args with $(VAR) replaced as the kubelet does, from the container's env and the ConfigMap."""
    env = dict(CONFIG)
    for e in container.get("env", []):
        env[e["name"]] = e.get("value", str(pod_index) if e["name"] == "POD_INDEX" else "x")
    args = container["command"] + container.get("args", [])
    for a in args:
        for var in re.findall(r"\$\((\w+)\)", a):
            assert var in env, f"{container['name']}: $({var}) is not defined"
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("name", FILES)
def test_every_manifest_passes_the_kubernetes_schema_offline(name):
    for doc in load(name):
        kv.validate(doc, VERSION, strict=True)


def test_the_schema_check_refuses_a_wrong_manifest():
    doc = copy.deepcopy(one("dense.yaml", "Deployment"))
    doc["spec"]["replica"] = 1
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, VERSION, strict=True)
    doc = copy.deepcopy(one("dense.yaml", "Deployment"))
    containers(doc)[0]["ports"][0]["containerPort"] = "fifty"
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, VERSION, strict=True)


def test_every_container_has_health_probes_on_its_own_protocol():
    seen = set()
    for _, doc in workloads():
        for c in containers(doc):
            module = c["command"][2]
            seen.add(module)
            assert c["livenessProbe"] and (c.get("readinessProbe") or module == "expert_server"), c["name"]
            if module in ("expert_server", "services.dense"):
                port = int(flag(expanded(c), "--listen").rsplit(":", 1)[1])
                assert c["startupProbe"]["grpc"]["port"] == port  # grpc.health.v1
                assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 600
                ready = c.get("readinessProbe", c["livenessProbe"])
                assert ready["grpc"]["port"] == port
            else:
                assert c["readinessProbe"]["httpGet"]["path"] == "/health"
                assert c["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert seen == {"expert_server", "services.dense", "gateway"}


def test_the_dense_service_asks_for_one_gpu_and_the_experts_for_none():
    for _, doc in workloads():
        for c in containers(doc):
            limits = c["resources"]["limits"]
            if c["command"][2] == "services.dense":
                assert limits["nvidia.com/gpu"] == 1 and c["image"].startswith("tandem-cuda:")
            else:
                assert "nvidia.com/gpu" not in limits and c["image"].startswith("tandem-cpu:")
            assert not c["image"].endswith(":latest")


def test_services_select_pods_and_their_ports_exist():
    pods = [(doc["spec"]["template"]["metadata"]["labels"], containers(doc)) for _, doc in workloads()]
    for name in FILES:
        for svc in (d for d in load(name) if d["kind"] == "Service"):
            matched = [cs for labels, cs in pods if svc["spec"]["selector"].items() <= labels.items()]
            assert matched, svc["metadata"]["name"]
            ports = {p["name"] for cs in matched for c in cs for p in c.get("ports", [])}
            assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports, svc["metadata"]["name"]
    for _, doc in workloads():
        assert doc["spec"]["selector"]["matchLabels"].items() <= doc["spec"]["template"]["metadata"]["labels"].items()


def test_the_model_comes_from_the_claim_and_shared_memory_from_a_memory_volume():
    claim = one("config.yaml", "PersistentVolumeClaim")["metadata"]["name"]
    for name, doc in workloads():
        pod = doc["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in containers(doc):
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            for m in mounts.values():
                assert m["name"] in volumes, (name, c["name"], m["name"])
            if c["command"][2] != "gateway":
                models = mounts["/models"]
                assert models["readOnly"] and volumes[models["name"]]["persistentVolumeClaim"]["claimName"] == claim
                assert flag(expanded(c), "--model") == "/models"
            transport = flag(expanded(c), "--transport") if c["command"][2] == "services.dense" else None
            if transport == "shm" or "/dev/shm" in mounts:
                assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory", (name, c["name"])
        if any(flag(expanded(c), "--transport") == "shm" for c in containers(doc) if c["command"][2] == "services.dense"):
            assert all("/dev/shm" in {m["mountPath"] for m in c["volumeMounts"]} for c in containers(doc))


def test_each_expert_pod_owns_one_layer_range_and_the_dense_side_dials_each():
    experts = one("expert-server.yaml", "StatefulSet")
    service = one("expert-server.yaml", "Service")
    assert service["spec"]["clusterIP"] == "None" and experts["spec"]["serviceName"] == service["metadata"]["name"]
    (c,) = containers(experts)
    n = experts["spec"]["replicas"]
    ranges = [parse_layers(flag(expanded(c, i), "--layers"), int(flag(expanded(c, i), "--shard"))) for i in range(n)]
    assert all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:])) and ranges[0][0] == 0
    compute = flag(expanded(c), "--compute-port")
    assert int(compute) in {p["port"] for p in service["spec"]["ports"]}  # GetInfo sends clients there
    (dense,) = containers(one("dense.yaml", "Deployment"))
    addresses = flag(expanded(dense), "--expert-servers").split(",")
    assert addresses == [f"{experts['metadata']['name']}-{i}.{service['metadata']['name']}:50061" for i in range(n)]
    assert flag(expanded(dense), "--transport") == "grpc"  # another node: tensors inline


def test_the_env_the_processes_read():
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in CONFIG
    for _, doc in workloads():
        for c in containers(doc):
            assert any(e["name"] == "OTEL_SERVICE_NAME" for e in c["env"]), c["name"]
            assert {"configMapRef": {"name": "tandem-config"}} in c["envFrom"]
            if c["command"][2] == "gateway":
                key = next(e for e in c["env"] if e["name"] == "TANDEM_API_KEY")
                assert key["valueFrom"]["secretKeyRef"]["optional"] is True


def test_prometheus_scrapes_the_gateway_port():
    doc = one("gateway.yaml", "Deployment")
    notes = doc["spec"]["template"]["metadata"]["annotations"]
    (c,) = containers(doc)
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
    assert int(notes["prometheus.io/port"]) == int(flag(expanded(c), "--port")) == c["ports"][0]["containerPort"]


@pytest.mark.parametrize("name", FILES)
def test_every_command_takes_its_flags(name):
    for doc in load(name):
        if doc["kind"] in WORKLOADS:
            for c in containers(doc):
                accepts(expanded(c))


def test_a_layer_list_and_a_shard_pick_one_range():
    assert parse_layers("1-2,3-5", 1) == (3, 5) and parse_layers("4", None) == (4, 4)
