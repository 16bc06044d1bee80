"""The committed openapi/openapi.json is the running app's document: regenerate it with `memex openapi`."""

from __future__ import annotations

import json
from pathlib import Path

from api.cli import openapi_document

COMMITTED = Path(__file__).resolve().parents[1] / "openapi" / "openapi.json"


def test_committed_openapi_matches_the_app():
    assert COMMITTED.exists(), "run: memex openapi"
    assert json.loads(COMMITTED.read_text()) == json.loads(openapi_document()), (
        "openapi/openapi.json is stale: run `memex openapi` and commit the result"
    )


def test_every_operation_is_documented(live, client):
    served = client.get("/schema/openapi.json").json()
    assert served["info"]["title"] == "Memex API"
    assert {"apiKey", "accessJwt"} <= set(served["components"]["securitySchemes"])
    for path, item in served["paths"].items():
        for method, op in item.items():
            assert op.get("operationId"), (method, path)
            assert op.get("tags"), (method, path)
            if path.startswith(("/kb/", "/hooks/")):
                # published knowledge and GitHub's webhook: a credential is optional (the tier) or a signature;
                # below the tier the answer is 401 or 404, never 403 (nothing is confirmed to exist)
                assert {"401", "404"} <= set(op["responses"]) and "403" not in op["responses"], (method, path)
            elif path not in ("/health", "/v1/signup"):
                assert {"401", "403"} <= set(op["responses"]), (method, path)
