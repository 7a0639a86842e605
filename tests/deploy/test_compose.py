"""The compose files: services, health checks, start order, GPU, shared memory, volumes, and every
command they run exists in the project and accepts its flags."""

import importlib
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def substitute(arg: str) -> str:
    """${VAR:-default} -> default, ${VAR:?message} / ${VAR} -> a placeholder value."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*)|:\?[^}]*)?\}", lambda m: m.group(2) if m.group(2) is not None else "x:1", arg)


def accepts(command: list[str]) -> None:
    """The module exists and its own argument parser takes the flags (no model needed)."""
    assert command[:2] == ["python", "-m"], command
    module, args = command[2], [substitute(a) for a in command[3:]]
    if module == "expert_server":
        from expert_server.__main__ import serve_parser

        serve_parser().parse_args(args)
    elif module == "services.dense":
        from services.dense.__main__ import parser

        parser().parse_args(args)
    elif module == "gateway":
        from gateway.__main__ import config

        config(args)
    else:
        assert importlib.util.find_spec(module) is not None, module


def healthcheck_command(service: dict) -> list[str]:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD"
    return test[1:]


def test_single_host_stack():
    c = load("docker-compose.yml")["services"]
    assert set(c) == {"jaeger", "expert-server", "dense", "gateway"}
    for name, service in c.items():
        assert service["healthcheck"]["start_period"], name
    assert c["expert-server"]["depends_on"]["jaeger"]["condition"] == "service_healthy"
    assert c["dense"]["depends_on"]["expert-server"]["condition"] == "service_healthy"
    assert c["gateway"]["depends_on"]["dense"]["condition"] == "service_healthy"
    assert int(c["expert-server"]["healthcheck"]["start_period"].rstrip("s")) >= 300  # loading a big model
    gpu = c["dense"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert c["expert-server"]["ipc"] == "shareable" and c["dense"]["ipc"] == "service:expert-server"
    assert c["expert-server"]["shm_size"]
    assert "--transport" in c["dense"]["command"] and "shm" in c["dense"]["command"]
    for name in ("expert-server", "dense"):
        assert any(v.endswith(":/models:ro") for v in c[name]["volumes"])
    assert c["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true" and "16686:16686" in c["jaeger"]["ports"]
    for name in ("expert-server", "dense", "gateway"):
        assert c[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert ":" in c[name]["image"] and not c[name]["image"].endswith(":latest")
    assert ":" in c["jaeger"]["image"] and not c["jaeger"]["image"].endswith(":latest")


def test_remote_expert_host_pair():
    remote = load("docker-compose.remote.yml")["services"]
    experts = load("docker-compose.expert-host.yml")["services"]
    assert "expert-server" not in remote and set(experts) == {"expert-server"}
    command = remote["dense"]["command"]
    assert command[command.index("--transport") + 1] == "grpc"
    assert "50061:50061" in experts["expert-server"]["ports"]
    expert_command = experts["expert-server"]["command"]
    compute_port = expert_command[expert_command.index("--compute-port") + 1]
    assert f"{compute_port}:{compute_port}" in experts["expert-server"]["ports"]  # clients are told this port


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.remote.yml", "docker-compose.expert-host.yml"])
def test_every_command_exists_and_takes_its_flags(name):
    for service in load(name)["services"].values():
        if "command" in service:
            accepts(service["command"])
        test = healthcheck_command(service)
        if test[:2] == ["python", "-m"]:
            accepts(test)


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_images_are_pinned(name):
    text = (DEPLOY / name).read_text()
    base = re.search(r"^FROM (\S+)", text, re.M).group(1)
    assert ":" in base and not base.endswith(":latest")
    assert "pip install" in text and "build_ext --inplace" in text and "grpc_tools.protoc" in text


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.remote.yml", "docker-compose.expert-host.yml"])
def test_every_tandem_service_restarts_after_a_crash(name):
    for key, service in load(name)["services"].items():
        if service.get("image", "").startswith("tandem-"):
            assert service.get("restart") in ("unless-stopped", "always", "on-failure"), (name, key)
