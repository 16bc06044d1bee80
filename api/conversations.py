"""Conversations over REST and MCP: thin handlers over the organization's ``Conversations`` service.

REST (``ConversationController`` and the admin backfill route) and the MCP tools (registered on import
through ``api.mcp.register_tools``) call the same service methods.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar import Controller, Response, delete, get, post
from litestar.di import Provide
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import Parameter

from api.errors import error_responses
from api.mcp import McpTool, output_schema, register_tools, to_plain
from api.routes import ADMIN, AUTH_ERRORS, READ, WRITE, org_services
from api.wiring import OrgServices
from services.conversations.models import (
    AppendResult, BackfillResult, Conversation, ConversationDetail, ConversationPage, MessageIn, MessagePage,
)
from services.errors import InvalidInput
from services.models import SearchResult
from services.search.search import SearchOptions
from services.text.temporal import TIME_JSON_SCHEMA, TimeValue, time_options

#: An append that wrote nothing new: the Idempotency-Key's original result, or every client_id already stored.
REPLAYED = ResponseSpec(data_container=AppendResult, generate_examples=False,
                        description="A replay: nothing new was written; replayed counts the messages stored before")

__all__ = ["ConversationCreateIn", "AppendIn", "ConversationController", "backfill_compress",
           "conversation_handlers", "CONVERSATION_TOOLS"]


class ConversationCreateIn(msgspec.Struct, forbid_unknown_fields=True):
    title: Annotated[str, msgspec.Meta(max_length=500)] | None = None
    metadata: dict[str, Any] | None = None


class AppendIn(msgspec.Struct, forbid_unknown_fields=True):
    #: 1-100 messages, appended in this order; each content at most 64 KiB of UTF-8.
    messages: Annotated[list[MessageIn], msgspec.Meta(min_length=1, max_length=100)]
    #: The time of the messages that carry no created_at / ts (e.g. the date of the session being imported):
    #: epoch milliseconds or ISO-8601. Default: the time of the append.
    created_at: TimeValue | None = None
    #: The session label of the messages that carry none.
    session: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None


ConversationId = Annotated[str, Parameter(max_length=64, description="conversation id")]
MAX_SEQUENCE = 2**53 - 1
From = Annotated[int, Parameter(query="from", ge=1, le=MAX_SEQUENCE, description="first sequence to return")]
To = Annotated[int | None, Parameter(ge=1, le=MAX_SEQUENCE, description="last sequence to return (inclusive)")]
PageLimit = Annotated[int, Parameter(ge=1, le=1000, description="messages per page")]
ListLimit = Annotated[int, Parameter(ge=1, le=100)]
Before = Annotated[str | None, Parameter(max_length=100, pattern=r"^[0-9]{1,15}:[0-9A-Za-z_-]{1,64}$",
                                         description="cursor from next_before")]
IdempotencyKey = Annotated[
    str | None,
    Parameter(header="Idempotency-Key", min_length=1, max_length=255, required=False,
              description="a retry with the same key and body returns the original response and appends nothing"),
]


class ConversationController(Controller):
    path = "/v1/conversations"
    tags = ["conversations"]
    dependencies = {"org": Provide(org_services)}

    @post("/", operation_id="createConversation", guards=[WRITE], status_code=201,
          responses=error_responses(400, 413, *AUTH_ERRORS), summary="Create a conversation",
          description=("Write scope. An empty conversation with an optional title and metadata; append messages to it with POST "
                       "/v1/conversations/{conversation_id}/messages."))
    async def create(self, data: ConversationCreateIn, org: OrgServices) -> Conversation:
        return await org.conversations.create(title=data.title, metadata=data.metadata)

    @get("/", operation_id="listConversations", guards=[READ], responses=error_responses(400, *AUTH_ERRORS),
         summary="Conversations, most recently active first",
         description=("Read scope. A page of conversations (title, message count, times), the most recently appended first; "
                      "page on with `before`."))
    async def list_recent(self, org: OrgServices, limit: ListLimit = 20, before: Before = None) -> ConversationPage:
        return await org.conversations.list_recent(limit=limit, before=before)

    @get("/{conversation_id:str}", operation_id="getConversation", guards=[READ],
         responses=error_responses(400, 404, *AUTH_ERRORS),
         summary="A conversation with a page of its messages (in sequence order) and its indexing state",
         description=("Read scope. The conversation, a page of its messages from `from` (verbatim, whatever their storage "
                      "encoding) and how far its passages are indexed. Another organization's id is 404."))
    async def get_one(self, conversation_id: ConversationId, org: OrgServices, from_: From = 1,
                      limit: PageLimit = 100) -> ConversationDetail:
        return await org.conversations.get(conversation_id, from_sequence=from_, limit=limit)

    @delete("/{conversation_id:str}", operation_id="deleteConversation", guards=[WRITE],
            responses=error_responses(404, *AUTH_ERRORS),
            summary="Delete a conversation: messages, chunks, keyword index and vectors",
            description=("Write scope. Removes the conversation with every message, passage, keyword index entry and vector, at "
                         "once."))
    async def delete_one(self, conversation_id: ConversationId, org: OrgServices) -> None:
        await org.conversations.delete(conversation_id)

    @post("/{conversation_id:str}/messages", operation_id="appendMessages", guards=[WRITE], status_code=201,
          responses={200: REPLAYED, **error_responses(400, 404, 409, 413, *AUTH_ERRORS)},
          summary="Append 1-100 messages (sequences are assigned by the server, contiguous from 1); 200 for a replay",
          description=("Write scope. Messages are stored verbatim, in order, with server-assigned sequences. Send "
                       "`Idempotency-Key` (or a `client_id` per message) to make a retry safe: a replay answers 200 and writes "
                       "nothing. Passages are keyword-searchable at once and embedded by the worker."))
    async def append(self, conversation_id: ConversationId, data: AppendIn, org: OrgServices,
                     idempotency_key: IdempotencyKey = None) -> Response[AppendResult]:
        result, replayed = await org.conversations.append(conversation_id, data.messages, idempotency_key=idempotency_key,
                                                          created_at=data.created_at, session=data.session)
        headers = {"Idempotent-Replayed": "true"} if replayed else None
        return Response(result, status_code=200 if replayed else 201, headers=headers)

    @get("/{conversation_id:str}/messages", operation_id="listMessages", guards=[READ],
         responses=error_responses(400, 404, *AUTH_ERRORS), summary="Messages in a sequence range, in order",
         description="Read scope. The messages with sequences from `from` to `to` (inclusive), at most `limit`, verbatim.")
    async def messages(self, conversation_id: ConversationId, org: OrgServices, from_: From = 1, to: To = None,
                       limit: PageLimit = 100) -> MessagePage:
        return await org.conversations.messages(conversation_id, from_sequence=from_, to_sequence=to, limit=limit)


@post("/v1/admin/backfill/compress", operation_id="backfillCompress", tags=["admin"], guards=[ADMIN], status_code=200,
      dependencies={"org": Provide(org_services)}, responses=error_responses(400, *AUTH_ERRORS),
      summary="Compress one batch of the organization's legacy (uncompressed) messages; resume with next_cursor",
      description=("Admin scope. Messages stored before compression existed are rewritten compressed, a batch per call; their "
                   "text does not change. Call again with `next_cursor` until it is null."))
async def backfill_compress(
    org: OrgServices,
    batch_size: Annotated[int, Parameter(ge=1, le=1000, description="messages per batch")] = 200,
    cursor: Annotated[str | None, Parameter(max_length=64, description="next_cursor of the previous batch")] = None,
) -> BackfillResult:
    return await org.conversations.backfill_compress(batch_size=batch_size, cursor=cursor)


conversation_handlers = [ConversationController, backfill_compress]


# -- MCP tools -----------------------------------------------------------------------------------------


def _obj(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


_CID = {"type": "string", "minLength": 1, "maxLength": 64, "description": "conversation id"}
_MESSAGE = _obj(
    {
        "role": {"type": "string", "enum": ["user", "assistant", "system", "tool"]},
        "content": {"type": "string", "description": "verbatim text (at most 64 KiB of UTF-8)"},
        "metadata": {"type": "object", "description": "any JSON object"},
        "client_id": {"type": "string", "minLength": 1, "maxLength": 128,
                      "description": "your id for this message: appending it again returns the original"},
        "created_at": {**TIME_JSON_SCHEMA, "description": "when it was said: epoch milliseconds or ISO-8601 (default: now)"},
        "ts": {**TIME_JSON_SCHEMA, "description": "the same as created_at"},
        "session": {"type": "string", "minLength": 1, "maxLength": 200, "description": "your session label"},
    },
    ["role", "content"],
)


def _messages(raw: Any) -> list[MessageIn]:
    try:
        return msgspec.convert(raw, list[MessageIn])
    except msgspec.ValidationError as exc:
        raise InvalidInput(f"invalid messages: {exc}", details={"field": "messages"}) from exc


async def _create(org: OrgServices, a: dict[str, Any]) -> dict[str, Any]:
    return to_plain(await org.conversations.create(title=a.get("title"), metadata=a.get("metadata")))


async def _append(org: OrgServices, a: dict[str, Any]) -> dict[str, Any]:
    result, _ = await org.conversations.append(a["conversation_id"], _messages(a.get("messages")),
                                               idempotency_key=a.get("idempotency_key"),
                                               created_at=a.get("created_at"), session=a.get("session"))
    return to_plain(result)


async def _get(org: OrgServices, a: dict[str, Any]) -> dict[str, Any]:
    return to_plain(await org.conversations.get(a["conversation_id"], from_sequence=a.get("from", 1),
                                                limit=a.get("limit", 100)))


async def _list(org: OrgServices, a: dict[str, Any]) -> dict[str, Any]:
    return to_plain(await org.conversations.list_recent(limit=a.get("limit", 20), before=a.get("before")))


async def _delete(org: OrgServices, a: dict[str, Any]) -> dict[str, Any]:
    await org.conversations.delete(a["conversation_id"])
    return {"conversation_id": a["conversation_id"], "deleted": True}


async def _search(org: OrgServices, a: dict[str, Any]) -> dict[str, Any]:
    kinds = ("conversation", "thought") if a.get("include_thoughts") else ("conversation",)
    return to_plain(await org.search.search(
        SearchOptions(query=a["query"], top_k=a.get("top_k", 10), kinds=kinds, parent_id=a.get("conversation_id"),
                      **time_options(a.get("from"), a.get("to"), a.get("reference_time")))
    ))


CONVERSATION_TOOLS: list[McpTool] = [
    McpTool(
        "create_conversation", "write", "Start a conversation in this organization's memory; returns its id.",
        _obj({"title": {"type": "string", "maxLength": 500},
              "metadata": {"type": "object", "description": "any JSON object"}}, []),
        output_schema(Conversation), _create,
    ),
    McpTool(
        "append_messages", "write",
        "Append 1-100 messages, verbatim and in order, to a conversation. Sequences are assigned by the server. "
        "Messages with a client_id already stored are not appended again (a retry returns the original ids).",
        _obj({"conversation_id": _CID,
              "messages": {"type": "array", "items": _MESSAGE, "minItems": 1, "maxItems": 100},
              "idempotency_key": {"type": "string", "minLength": 1, "maxLength": 255,
                                  "description": "the same key and messages again return the original result"},
              "created_at": {**TIME_JSON_SCHEMA,
                             "description": "time of the messages without their own (e.g. the session's date)"},
              "session": {"type": "string", "minLength": 1, "maxLength": 200,
                          "description": "session label of the messages without their own"}},
             ["conversation_id", "messages"]),
        output_schema(AppendResult), _append,
    ),
    McpTool(
        "get_conversation", "read", "A conversation with a page of its messages in order (page with from / next_from).",
        _obj({"conversation_id": _CID, "from": {"type": "integer", "minimum": 1, "maximum": MAX_SEQUENCE, "default": 1},
              "limit": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}}, ["conversation_id"]),
        output_schema(ConversationDetail), _get,
    ),
    McpTool(
        "list_conversations", "read", "Conversations, most recently active first; page with before = next_before.",
        _obj({"limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
              "before": {"type": "string", "maxLength": 100}}, []),
        output_schema(ConversationPage), _list,
    ),
    McpTool(
        "delete_conversation", "write", "Delete a conversation with all its messages, chunks and vectors.",
        _obj({"conversation_id": _CID}, ["conversation_id"]),
        {"type": "object", "properties": {"conversation_id": {"type": "string"}, "deleted": {"type": "boolean"}},
         "required": ["conversation_id", "deleted"]},
        _delete,
    ),
    McpTool(
        "search_conversations", "read",
        "Search conversations by meaning and keywords (optionally one conversation, optionally thoughts too). Hits are "
        "single messages, best first, not crowded by neighbours of one hit: best_sequence / message_id name the message, "
        "messages is the window around it. from / to filter on when messages were said; relative dates in the "
        "query ('last week') favour messages of that range.",
        _obj({"query": {"type": "string", "minLength": 1, "maxLength": 4000},
              "conversation_id": _CID,
              "from": {**TIME_JSON_SCHEMA, "description": "epoch ms or ISO-8601: said at or after"},
              "to": {**TIME_JSON_SCHEMA, "description": "epoch ms or ISO-8601: said at or before"},
              "reference_time": {**TIME_JSON_SCHEMA,
                                 "description": "what relative dates in the query are relative to (default now)"},
              "top_k": {"type": "integer", "minimum": 1, "maximum": 100, "default": 10},
              "include_thoughts": {"type": "boolean", "default": False}}, ["query"]),
        output_schema(SearchResult), _search,
    ),
]

register_tools(CONVERSATION_TOOLS)
