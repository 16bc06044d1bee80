"""GitHub's push webhook for a knowledge base: ``POST /hooks/github/{kb_id}``.

The URL names the knowledge base only (its id, random, from the creation response); the control database routes
it to its organization (``knowledge_base_routes``). The body must be signed with the knowledge base's webhook
secret (``X-Hub-Signature-256: sha256=<HMAC-SHA256 of the body>``, compared in constant time; 401 otherwise,
before the body is even parsed). ``ping`` is answered; pushes to another branch are ignored (200, saying why); a
redelivery (the same ``X-GitHub-Delivery``) queues nothing; a push queues an incremental sync (202) and returns:
the sync runs in the job worker, never in the request.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from typing import Annotated, Literal

import msgspec
from litestar import Request, Response, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import Parameter

from api.errors import error_responses
from api.wiring import Memex
from services.errors import InvalidInput, NotFound, Unauthenticated

__all__ = ["webhook_handlers", "WebhookResult", "signature"]

_KB_ID = re.compile(r"^kb_[0-9a-f]{16}$")


class WebhookResult(msgspec.Struct, omit_defaults=True):
    #: queued: a sync was queued (or a queued one reused); duplicate: this delivery was seen before; ignored: not a
    #: push to the followed branch; pong: the answer to ping.
    status: Literal["queued", "duplicate", "ignored", "pong"]
    knowledge_base: str
    sync_id: str | None = None
    reason: str | None = None


def signature(secret: str, body: bytes) -> str:
    """The X-Hub-Signature-256 value GitHub sends for ``body``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


@post("/hooks/github/{kb_id:str}", operation_id="githubPushWebhook", tags=["knowledge"], security=[{}],
      exclude_from_auth=True, status_code=202,
      responses={200: ResponseSpec(data_container=WebhookResult, generate_examples=False,
                                   description="ping answered; another event, another branch or a redelivery ignored"),
                 **error_responses(400, 401, 404)},
      summary="GitHub push webhook: verifies the signature and queues an incremental sync",
      description="Set it in the repository's settings: payload URL `<service>/hooks/github/{id}`, content type "
                  "application/json, the secret from the creation response (or POST .../webhook-secret), push events. "
                  "Answers 202 with the queued sync, 200 for ping, other events, other branches and redeliveries.")
async def github_push(request: Request,
                      kb_id: Annotated[str, Parameter(min_length=1, max_length=64, description="knowledge base id")],
                      ) -> Response[WebhookResult]:
    memex: Memex = request.app.state.memex
    if not _KB_ID.match(kb_id):
        raise NotFound("knowledge base not found")
    routed = (await memex.control.execute("SELECT organization_id FROM knowledge_base_routes WHERE id = ?",
                                          (kb_id,))).rows
    if not routed:
        raise NotFound("knowledge base not found")
    org_id = routed[0]["organization_id"]
    store = await memex.stores.open(org_id)
    knowledge = memex.knowledge(org_id, store.sql, store.vectors)
    row = await knowledge.bases.row(kb_id)
    body = await request.body()
    sent = request.headers.get("x-hub-signature-256") or ""
    if not hmac.compare_digest(sent.encode(), signature(row["webhook_secret"], body).encode()):
        raise Unauthenticated("missing or invalid X-Hub-Signature-256", details={"header": "X-Hub-Signature-256"})
    event = request.headers.get("x-github-event", "")
    slug = row["slug"]
    if event == "ping":
        return Response(WebhookResult("pong", slug), status_code=200)
    if event != "push":
        return Response(WebhookResult("ignored", slug, reason=f"event {event[:50]!r}: only push events sync"),
                        status_code=200)
    try:
        payload = json.loads(body)
    except ValueError:
        raise InvalidInput("the push payload is not JSON (set the webhook's content type to application/json)",
                           details={"field": "body"}) from None
    source = json.loads(row["source"])
    ref = payload.get("ref") if isinstance(payload, dict) else None
    if source["type"] != "git":
        return Response(WebhookResult("ignored", slug, reason="this knowledge base is filled by uploads"), status_code=200)
    branch = f"refs/heads/{source.get('branch') or 'main'}"
    if ref != branch:
        return Response(WebhookResult("ignored", slug, reason=f"push to {str(ref)[:200]}; this knowledge base follows "
                                                                f"{branch}"), status_code=200)
    delivery = (request.headers.get("x-github-delivery") or "").strip()[:100] or None
    if delivery is not None:
        seen = await knowledge.bases.seen_delivery(kb_id, delivery)
        if seen is not None:
            return Response(WebhookResult("duplicate", slug, sync_id=seen or None,
                                          reason="this delivery was received before"), status_code=200)
    sync_id, _ = await knowledge.bases.request_sync(row, "webhook", delivery_id=delivery)
    return Response(WebhookResult("queued", slug, sync_id=sync_id), status_code=202)


webhook_handlers = [github_push]
