"""schemathesis against the live app, every operation: no 5xx, responses match the documented schema,
bad input is rejected, auth is enforced."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import allow_header_conformance, ignored_auth

from tests.conftest import start_live

ORG: dict[str, str] = {}


@pytest.fixture(scope="module")
def st_live(tmp_path_factory):
    server, ctx = start_live(tmp_path_factory.mktemp("schemathesis"), embedder="hash")
    r = httpx.post(server.base_url + "/v1/signup", json={"name": "Fuzz", "slug": "fuzz-org"})
    ORG.update(key=r.json()["api_key"]["key"], slug="fuzz-org")
    # something to find, so reads exercise their full response shapes
    httpx.post(server.base_url + "/v1/thoughts", json={"content": "fuzz seed thought about anything"},
               headers={"authorization": f"Bearer {ORG['key']}"})
    yield server
    ctx.__exit__(None, None, None)


@pytest.fixture(scope="module")
def api_schema(st_live):
    return schemathesis.openapi.from_url(st_live.base_url + "/schema/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_api_conforms(case):
    headers = {"authorization": f"Bearer {ORG['key']}"}
    if case.operation.path == "/v1/keys/{key_id}" and case.method.upper() == "DELETE":
        # never let the fuzzer revoke the key it is using
        case.path_parameters = {"key_id": "key_0000000000000000"}
    # Excluded: ignored_auth replays with the header we add here, which it cannot strip (auth enforcement is
    # asserted by test_tenancy_api, test_cross_tenant and test_access_http); allow_header_conformance trips on
    # Litestar's auto-generated OPTIONS reply, whose Allow header names only one of a path's methods.
    case.call_and_validate(headers=headers, excluded_checks=[ignored_auth, allow_header_conformance])
