"""Schemathesis against the gateway's own OpenAPI schema: no 5xx, no response outside the schema."""

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("tandem_native")

from hypothesis import HealthCheck, settings  # noqa: E402

from tests.checkpoints import checkpoint  # noqa: E402
from tests.gateway.servers import dense, gateway  # noqa: E402

pytestmark = [pytest.mark.native, pytest.mark.slow]


@pytest.fixture(scope="module")
def live():
    running = dense(checkpoint("qwen3_moe"), kv_tokens=8192)
    with gateway(running.port) as (url, _):
        yield url
    running.stop(1)


def test_generated_requests_never_get_a_5xx_or_an_off_schema_answer(live):
    from schemathesis.checks import not_a_server_error
    from schemathesis.core.failures import FailureGroup
    from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

    schema = schemathesis.openapi.from_url(live + "/openapi.json")
    failures = []
    for operation in schema.get_all_operations():
        op = operation.ok()
        strategy = op.as_strategy()

        @settings(max_examples=60, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            response = case.call(base_url=live, timeout=30)
            try:
                case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                          response_schema_conformance])
            except FailureGroup as exc:  # every failed check of this case
                failures.append(f"{op.label}: {exc}")

        from hypothesis import given

        given(strategy)(run)()
    assert not failures, "\n".join(failures[:5])
