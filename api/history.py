"""The history of merged / replaced originals over REST and MCP (services.thoughts.history): list, restore, purge.

Registers its MCP tools on import (``thought_history``: read; ``restore_thought``: write). Another
organization's ids are 404 like everywhere else: every statement is bound to the caller's organization.
"""

from __future__ import annotations

from typing import Annotated, Any

from litestar import Controller, Response, delete, get, post
from litestar.di import Provide
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import Parameter

from api.errors import error_responses
from api.mcp import McpTool, _obj, output_schema, register_tools, to_plain
from api.routes import AUTH_ERRORS, READ, WRITE, org_services
from api.wiring import OrgServices
from services.models import CaptureResult, ThoughtHistory

__all__ = ["HistoryController", "history_handlers", "HISTORY_TOOLS"]

ThoughtId = Annotated[str, Parameter(max_length=64, description="thought id (the canonical thought)")]
HistoryId = Annotated[str, Parameter(max_length=64, description="history entry id")]


class HistoryController(Controller):
    path = "/v1/thoughts/{thought_id:str}/history"
    tags = ["thoughts"]
    dependencies = {"org": Provide(org_services)}

    @get("/", operation_id="getThoughtHistory", guards=[READ], responses=error_responses(404, *AUTH_ERRORS),
         summary="The originals this thought superseded (merged or replaced), newest first",
         description=("Read scope. When a capture merged into or replaced this thought, the text it had before is kept as a "
                      "history entry; this lists them, newest first."))
    async def list_history(self, thought_id: ThoughtId, org: OrgServices) -> ThoughtHistory:
        return await org.thoughts.history.list(thought_id)

    @post("/{history_id:str}/restore", operation_id="restoreThoughtHistory", guards=[WRITE], status_code=201,
          responses={200: ResponseSpec(data_container=CaptureResult,
                                       description="The same content is stored already: that thought"),
                     **error_responses(404, *AUTH_ERRORS)},
          summary="Recreate a history entry as a thought (a normal capture, no write-time decision), then drop the entry",
          description=("Write scope. Brings an original back as its own thought (201; 200 when that content is stored already) "
                       "and removes the history entry."))
    async def restore(self, thought_id: ThoughtId, history_id: HistoryId, org: OrgServices) -> Response[CaptureResult]:
        res = await org.thoughts.history.restore(thought_id, history_id)
        return Response(res, status_code=201 if res.created else 200)

    @delete("/", operation_id="purgeThoughtHistory", guards=[WRITE], responses=error_responses(404, *AUTH_ERRORS),
            summary="Delete every history entry of this thought, for good",
            description="Write scope. Removes every kept original of this thought; they cannot be restored afterwards.")
    async def purge(self, thought_id: ThoughtId, org: OrgServices) -> None:
        await org.thoughts.history.purge(thought_id)

    @delete("/{history_id:str}", operation_id="deleteThoughtHistoryEntry", guards=[WRITE],
            responses=error_responses(404, *AUTH_ERRORS), summary="Delete one history entry, for good",
            description="Write scope. Removes one kept original; it cannot be restored afterwards.")
    async def purge_one(self, thought_id: ThoughtId, history_id: HistoryId, org: OrgServices) -> None:
        await org.thoughts.history.purge(thought_id, history_id)


history_handlers = [HistoryController]

_ID = {"type": "string", "minLength": 1, "maxLength": 64}


async def _history(org: OrgServices, a: dict[str, Any]) -> dict[str, Any]:
    return to_plain(await org.thoughts.history.list(a["id"]))


async def _restore(org: OrgServices, a: dict[str, Any]) -> dict[str, Any]:
    return to_plain(await org.thoughts.history.restore(a["id"], a["history_id"]))


HISTORY_TOOLS = [
    McpTool(
        "thought_history", "read",
        "The originals a thought superseded: content that a merge or a replace moved out of the way (restorable).",
        _obj({"id": _ID}, ["id"]), output_schema(ThoughtHistory), _history,
    ),
    McpTool(
        "restore_thought", "write",
        "Bring a merged or replaced original back as a thought of its own (and remove it from the history).",
        _obj({"id": {**_ID, "description": "the thought whose history holds the entry"},
              "history_id": {**_ID, "description": "the history entry"}}, ["id", "history_id"]),
        output_schema(CaptureResult), _restore,
    ),
]
register_tools(HISTORY_TOOLS)
