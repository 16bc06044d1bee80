"""Enrichment over REST: the admin route that runs the two-pass backfill one batch at a time."""

from __future__ import annotations

from typing import Annotated

from litestar import post
from litestar.di import Provide
from litestar.params import Parameter

from api.errors import error_responses
from api.routes import ADMIN, AUTH_ERRORS, org_services
from api.wiring import OrgServices
from services.enrichment.backfill import Backfill, EnrichBackfillResult

__all__ = ["backfill_enrich", "enrichment_handlers"]


@post("/v1/admin/backfill/enrich", operation_id="backfillEnrich", tags=["admin"], guards=[ADMIN], status_code=200,
      dependencies={"org": Provide(org_services)}, responses=error_responses(400, *AUTH_ERRORS),
      summary="Enrich one batch of the organization's thoughts without summary/tags (two passes, resumable); "
              "call again until done",
      description=("Admin scope. Gives thoughts that have none a summary, tags and importance with the configured language "
                   "model (MEMEX_LLM), a batch per call, within the organization's daily LLM budget (`stopped: budget` when "
                   "it is spent); the checkpoint is stored, so calls resume where the last one stopped."))
async def backfill_enrich(
    org: OrgServices,
    batch_size: Annotated[int, Parameter(ge=1, le=500, description="thoughts per call")] = 50,
    cursor: Annotated[str | None, Parameter(max_length=70, pattern=r"^[12]:[0-9A-Za-z_-]{0,64}$",
                                            description="cursor of the previous call (default: the stored checkpoint)")] = None,
    restart: Annotated[bool, Parameter(description="drop the checkpoint and start again at pass 1")] = False,
) -> EnrichBackfillResult:
    return await Backfill(org.enrichment).run(batch_size=batch_size, cursor=cursor, restart=restart)


enrichment_handlers = [backfill_enrich]
