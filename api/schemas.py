"""Request and response Structs of the REST API (domain read models come from services.models)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from services.text.temporal import TimeValue

from services.models import SearchHit

__all__ = [
    "CaptureBatchIn",
    "SignupIn", "OrganizationOut", "ApiKeyOut", "IssuedKeyOut", "SignupOut", "KeyCreateIn", "KeyList",
    "CaptureIn", "SearchIn", "SearchOut", "MemberIn", "MemberOut", "MemberList", "ServiceTokenIn",
    "ServiceTokenOut", "ServiceTokenList", "WhoAmI", "Health",
]

Scope = Literal["read", "write", "admin"]
Kind = Literal["thought", "conversation"]


class SignupIn(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    slug: Annotated[str, msgspec.Meta(min_length=3, max_length=40, pattern=r"^[a-z](-?[a-z0-9])+$",
                                      description="3-40 of a-z, 0-9 and single hyphens; "
                                                  "starts with a letter, ends with a letter or digit")]


class OrganizationOut(msgspec.Struct):
    id: str
    slug: str
    name: str
    created_at: int


class ApiKeyOut(msgspec.Struct):
    id: str
    name: str
    prefix: str
    scopes: list[str]
    created_at: int
    expires_at: int | None
    revoked_at: int | None
    last_used_at: int | None


class IssuedKeyOut(ApiKeyOut):
    #: The raw key. Shown in this response only; store it now.
    key: str


class SignupOut(msgspec.Struct):
    organization: OrganizationOut
    api_key: IssuedKeyOut
    mcp_url: str


class KeyCreateIn(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=100)]
    scopes: Annotated[list[Scope], msgspec.Meta(min_length=1, max_length=3)] = msgspec.field(
        default_factory=lambda: ["read", "write"])
    #: Seconds until the key expires; 0 (the default) means it never does.
    expires_in_seconds: Annotated[int, msgspec.Meta(ge=0, le=10 * 365 * 86400, description="0 = never expires")] = 0


class KeyList(msgspec.Struct):
    keys: list[ApiKeyOut]


class CaptureIn(msgspec.Struct, forbid_unknown_fields=True):
    content: Annotated[str, msgspec.Meta(min_length=1, description="markdown text, at most 256 KiB of UTF-8 (413 above)")]
    source: Annotated[str, msgspec.Meta(max_length=500)] | None = None
    metadata: dict[str, Any] | None = None
    #: Wait for the write-time decision (duplicate, contradiction, merge...) before answering. By default the capture
    #: is acknowledged as soon as it is durable and keyword-searchable, with decision "pending"; the worker decides
    #: moments later and the thought shows the outcome (GET /v1/thoughts/{id}: decision, history).
    wait: bool = False


class CaptureBatchIn(msgspec.Struct, forbid_unknown_fields=True):
    #: 1-1,000 captures, each the body of POST /v1/thoughts.
    items: Annotated[list[CaptureIn], msgspec.Meta(min_length=1, max_length=1000)]


class SearchIn(msgspec.Struct, forbid_unknown_fields=True):
    query: Annotated[str, msgspec.Meta(min_length=1, max_length=4000)]
    top_k: Annotated[int, msgspec.Meta(ge=1, le=100)] = 10  # services.search.search.MAX_TOP_K
    tags: Annotated[list[Annotated[str, msgspec.Meta(max_length=100)]], msgspec.Meta(max_length=50)] = msgspec.field(
        default_factory=list)
    kinds: Annotated[list[Kind], msgspec.Meta(max_length=2)] = msgspec.field(default_factory=lambda: ["thought"])
    conversation_id: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    include_content: bool = False
    explain: bool = False
    #: Drop hits scoring below this. Absent: the relevance floor drops hits whose keyword and vector evidence
    #: are both weak (so an unrelated query returns few or none); 0 returns every candidate.
    min_score: Annotated[float, msgspec.Meta(ge=0, le=10)] | None = None
    #: Only conversation messages said (created_at) at or after this time, and thoughts captured then: epoch
    #: milliseconds or an ISO-8601 date / date-time (no offset: UTC).
    time_from: TimeValue | None = msgspec.field(default=None, name="from")
    #: Only those said at or before this time (inclusive; a date alone is its midnight UTC).
    time_to: TimeValue | None = msgspec.field(default=None, name="to")
    #: What relative dates in the query ("last week", "in March") are relative to; default: now. Such a date
    #: boosts the messages said in its range (it never filters).
    reference_time: TimeValue | None = None


class SearchOut(msgspec.Struct):
    query: str
    results: list[SearchHit]


class MemberIn(msgspec.Struct, forbid_unknown_fields=True):
    email: Annotated[str, msgspec.Meta(min_length=3, max_length=320, pattern=r"^[^@ \t\r\n]{1,64}@[^@ \t\r\n]{1,255}$")]
    role: Literal["owner", "admin", "member", "viewer"] = "member"


class MemberOut(msgspec.Struct):
    email: str
    role: str
    created_at: int


class MemberList(msgspec.Struct):
    members: list[MemberOut]


class ServiceTokenIn(msgspec.Struct, forbid_unknown_fields=True):
    common_name: Annotated[str, msgspec.Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$",
                                             description="the Access service token's Client ID")]
    scopes: Annotated[list[Scope], msgspec.Meta(min_length=1, max_length=3)]
    name: Annotated[str, msgspec.Meta(max_length=100)] | None = None


class ServiceTokenOut(msgspec.Struct):
    common_name: str
    name: str
    scopes: list[str]
    created_at: int


class ServiceTokenList(msgspec.Struct):
    service_tokens: list[ServiceTokenOut]


class WhoAmI(msgspec.Struct):
    organization: OrganizationOut
    principal: str
    scopes: list[str]
    mcp_url: str


class Health(msgspec.Struct):
    status: str
    sql: str
    vectors: str
    embedder: str
    embedding_model: str
    pending_jobs: int
    #: Cloudflare API requests, retries and the client-side request budget (null on the embedded backend).
    cloudflare: dict[str, Any] | None = None
    #: Free bytes on the file system of the SQL store (null when not local). Writes answer 507 when it is full.
    free_bytes: int | None = None
    #: Why the job worker is paused (a full disk), or null while it runs; status is then "degraded".
    worker_paused: str | None = None
