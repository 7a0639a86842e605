import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common import grpc_defaults

REPO = Path(__file__).resolve().parents[3]


def _experiments_seen(package: str, env: dict) -> str:
    """GRPC_EXPERIMENTS as a fresh process sees it right after importing `package`."""
    code = f"import {package}, os; print(os.environ.get('GRPC_EXPERIMENTS', '<unset>'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _without_experiments() -> dict:
    return {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}


@pytest.mark.parametrize("package", ["services", "expert_server", "gateway", "bench._machine"])
def test_each_part_that_uses_grpc_sets_the_default_on_import(package):
    assert _experiments_seen(package, _without_experiments()) == grpc_defaults.EXPERIMENTS


def test_the_users_value_wins_even_empty():
    env = _without_experiments()
    assert _experiments_seen("services", {**env, "GRPC_EXPERIMENTS": "-event_engine_dns"}) == "-event_engine_dns"
    assert _experiments_seen("services", {**env, "GRPC_EXPERIMENTS": ""}) == ""
