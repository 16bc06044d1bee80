"""Talk to the service's MCP endpoint with the `mcp` SDK's own client, over real HTTP."""

from __future__ import annotations

from contextlib import asynccontextmanager

import httpx
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client


@asynccontextmanager
async def mcp_session(url: str, headers: dict[str, str]):
    async with httpx.AsyncClient(headers=headers, timeout=60) as http:
        async with streamable_http_client(url, http_client=http) as (read, write, _sid):
            async with ClientSession(read, write) as session:
                await session.initialize()
                yield session
