"""The knowledge-server seed's MCP surface (§7): seven tools, four resources and three prompts, shared by a knowledge
base's own MCP URL (``/kb/{org}/{kb}/mcp``, api.knowledge_public) and the organization's MCP URL, where the same
tools take a ``knowledge_base`` argument (registered here with api.mcp).

Each tool needs a tier (the seed's §2, §7.8): the five browse tools the knowledge base's own visibility, the two
that return whole documents its ``document_tier`` as well. Below it a tool answers the seed's error result,
``Requires <tier> access. Current: <tier>.``
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from api.mcp import McpTool, output_schema, register_tools, to_plain
from api.wiring import OrgServices
from services.errors import InvalidInput, NotFound
from services.knowledge.entries import Filters, KnowledgeReader, parse_date, term_of
from services.knowledge.models import Document, GroupInfo, KnowledgeBase, KnowledgeSearchResult, ReleaseInfo, Term
from services.knowledge.ontology import CONTENT_TYPES, PARENT_TYPES
from services.knowledge.search import MAX_LIMIT
from services.knowledge.service import Knowledge

__all__ = ["KbTool", "KB_TOOLS", "PROMPTS", "tier_error", "resource_list", "read_resource", "prompt_messages",
           "ontology_document", "ORG_TOOLS"]

TIER_LEVEL = {"open": 0, "public": 1, "members": 2}


def tier_error(required: str, current: str) -> str:
    """The seed's access error text (§7.5)."""
    return f"Requires {required} access. Current: {current}."


def required_tier(kb: dict[str, Any], needs: str) -> str:
    """The tier a caller needs for a tool: the knowledge base's visibility ('private' counts as members), and for
    whole documents also its document tier, whichever is higher."""
    base = "members" if kb["visibility"] == "private" else kb["visibility"]
    if needs == "document" and TIER_LEVEL[kb["document_tier"]] > TIER_LEVEL[base]:
        return kb["document_tier"]
    return base


# -- arguments ------------------------------------------------------------------------------------------------

_TEXT = {"type": "string", "minLength": 1, "maxLength": 1000}
_DATE = {"oneOf": [{"type": "string", "maxLength": 40, "description": "ISO-8601 date or date-time (no offset: UTC)"},
                   {"type": "integer", "description": "epoch milliseconds"}]}
FILTERS_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "contentType": {"type": "string", "enum": list(CONTENT_TYPES),
                        "description": "Filter by content type (pattern, tag, article...); a parent type (resource, "
                                       "story, data, reference) also matches the types below it"},
        "group": {"type": "string", "minLength": 1, "maxLength": 200, "description": "Filter by group"},
        "release": {"type": "string", "minLength": 1, "maxLength": 200, "description": "Filter by release (its id)"},
        "status": {"type": "string", "minLength": 1, "maxLength": 200, "description": "Filter by status"},
        "tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 100}, "maxItems": 20,
                 "description": "Entries with any of these tags"},
        "dateFrom": {**_DATE, "description": "Entries dated on or after this"},
        "dateTo": {**_DATE, "description": "Entries dated on or before this"},
        "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": 5,
                  "description": "Maximum results to return"},
    },
}


def filters_from(raw: dict[str, Any] | None) -> tuple[Filters, int]:
    raw = raw or {}
    f = Filters(content_type=raw.get("contentType"), group=raw.get("group"), release=raw.get("release"),
                status=raw.get("status"), tags=tuple(raw.get("tags") or ()),
                date_from=parse_date(raw.get("dateFrom"), "dateFrom"), date_to=parse_date(raw.get("dateTo"), "dateTo"))
    return f.check(), int(raw.get("limit", 5))


class TermResult(msgspec.Struct):
    term: str
    found: bool
    definition: Term | None = None


class LexiconResult(msgspec.Struct):
    keyword: str
    results: list[Term]


class GroupList(msgspec.Struct):
    groups: list[GroupInfo]


class ReleaseList(msgspec.Struct):
    releases: list[ReleaseInfo]


class KnowledgeBaseChoices(msgspec.Struct):
    knowledge_bases: list[KnowledgeBase]


# -- the tools ------------------------------------------------------------------------------------------------

Run = Callable[[Knowledge, KnowledgeReader, dict[str, Any]], Awaitable[tuple[Any, str | None]]]


@dataclass(frozen=True)
class KbTool:
    name: str
    description: str
    #: "kb": the knowledge base's visibility; "document": its document tier too.
    needs: str
    properties: dict[str, Any]
    required: list[str]
    output: type
    #: (structured result, text to show instead of its JSON or None)
    run: Run

    def input_schema(self, extra: dict[str, Any] | None = None, extra_required: tuple[str, ...] = ()) -> dict[str, Any]:
        return {"type": "object", "properties": {**(extra or {}), **self.properties},
                "required": [*extra_required, *self.required], "additionalProperties": False}


async def _search(ks: Knowledge, reader: KnowledgeReader, a: dict[str, Any], *, documents: bool = False):
    filters, limit = filters_from(a.get("filters"))
    return await ks.search(reader).search(a["query"], filters, limit=limit, include_documents=documents), None


async def _search_documents(ks: Knowledge, reader: KnowledgeReader, a: dict[str, Any]):
    return await _search(ks, reader, a, documents=True)


async def _define(ks: Knowledge, reader: KnowledgeReader, a: dict[str, Any]):
    term = await reader.define_term(a["term"])
    if term is None:
        return TermResult(a["term"], False), f'Term "{a["term"]}" not found in lexicon.'
    return TermResult(a["term"], True, term), f"{term.title}: {term.definition}"


async def _lexicon(ks: Knowledge, reader: KnowledgeReader, a: dict[str, Any]):
    found = await ks.search(reader).search(a["keyword"], Filters(content_type="tag"), limit=MAX_LIMIT)
    rows = await reader.rows_by_ids([h.id for h in found.results])
    return LexiconResult(a["keyword"], [term_of(rows[h.id]) for h in found.results if h.id in rows]), None


async def _groups(ks: Knowledge, reader: KnowledgeReader, a: dict[str, Any]):
    return GroupList(await reader.groups()), None


async def _releases(ks: Knowledge, reader: KnowledgeReader, a: dict[str, Any]):
    return ReleaseList(await reader.releases()), None


async def _document(ks: Knowledge, reader: KnowledgeReader, a: dict[str, Any]):
    try:
        return await reader.document(a["contentType"], a["id"]), None
    except NotFound:
        raise NotFound("Document not found", details={"contentType": a["contentType"], "id": a["id"][:64]}) from None


_QUERY = {"query": {**_TEXT, "description": "Natural language search query"}, "filters": FILTERS_SCHEMA}

KB_TOOLS: list[KbTool] = [
    KbTool("search_knowledge",
           "Search the knowledge base for documents by meaning and keywords, optionally filtered by content type, group, "
           "release, status, tags or date. Returns the best matching entries with the passage that matched.",
           "kb", _QUERY, ["query"], KnowledgeSearchResult, _search),
    KbTool("define_term",
           "Get the definition of a term from the knowledge base's lexicon (its 'tag' entries, matched by title or alias, "
           "ignoring case and punctuation). Use this when users ask 'what is X?'.",
           "kb", {"term": {**_TEXT, "maxLength": 200, "description": "Term to define"}}, ["term"], TermResult, _define),
    KbTool("search_lexicon", "Search lexicon entries by keyword. Returns matching terms with definitions.",
           "kb", {"keyword": {**_TEXT, "maxLength": 200, "description": "Keyword to search"}}, ["keyword"],
           LexiconResult, _lexicon),
    KbTool("list_groups", "List the groups of the knowledge base (the authoring groups entries belong to).",
           "kb", {}, [], GroupList, _groups),
    KbTool("list_releases",
           "List releases (folders holding an index.base, identified by their index.md) with their metadata.",
           "kb", {}, [], ReleaseList, _releases),
    KbTool("get_document", "Get the full content of a document by its contentType and ID, with its links and backlinks.",
           "document",
           {"contentType": {"type": "string", "enum": list(CONTENT_TYPES), "description": "Content type of the document"},
            "id": {"type": "string", "minLength": 1, "maxLength": 64, "description": "Document ID"}},
           ["contentType", "id"], Document, _document),
    KbTool("search_with_documents", "Search and return the full content of each result's document.",
           "document", _QUERY, ["query"], KnowledgeSearchResult, _search_documents),
]


# -- resources and prompts ------------------------------------------------------------------------------------

def ontology_document(kb: dict[str, Any], ontology: dict[str, Any]) -> dict[str, Any]:
    """The content type hierarchy and metadata schema of a knowledge base (the seed's data/ontology resource)."""
    from services.knowledge.ontology import Content

    children: dict[str, list[str]] = {}
    for leaf, parent in PARENT_TYPES.items():
        children.setdefault(parent, []).append(leaf)
    return {"content_types": list(CONTENT_TYPES), "hierarchy": children, "path_types": ontology.get("path_types"),
            "type_aliases": ontology.get("type_aliases"), "require_publish": ontology.get("require_publish"),
            "skip_drafts": ontology.get("skip_drafts"), "schema": msgspec.json.schema(Content),
            "filters": ["contentType", "group", "release", "status", "tags", "dateFrom", "dateTo"]}


def search_prompt(name: str) -> str:
    return (
        f"You are a research assistant for the knowledge base '{name}'. Answer from its documents, not from memory.\n"
        "- Use search_knowledge to find entries; narrow with filters (contentType, group, release, status, tags, dates) "
        "when the question names one.\n"
        "- Use define_term for 'what is X?' questions and search_lexicon to explore the vocabulary.\n"
        "- Use list_groups and list_releases to see how the knowledge base is organized.\n"
        "- Use get_document (or search_with_documents) to read a whole entry before quoting it; cite entries by title "
        "and id.\n"
        "- Say so when the knowledge base has nothing on a question."
    )


@dataclass(frozen=True)
class Prompt:
    name: str
    description: str
    arguments: list[tuple[str, str, bool]]
    render: Callable[[str, dict[str, str]], str]


def _research(name: str, a: dict[str, str]) -> str:
    deep = (a.get("depth") or "shallow") == "deep"
    body = ("Provide a comprehensive analysis including:\n1. Core concepts and definitions from the lexicon\n"
            "2. Related patterns and practices from the knowledge base\n3. External resources from the library\n"
            "4. Cross-references to other relevant topics\n5. Gaps or areas needing more documentation"
            if deep else
            "Provide a brief summary including:\n1. Key definition from the lexicon\n2. Most relevant document\n"
            "3. One or two external resources")
    return (f'Research the topic "{a["topic"]}" in the {name} knowledge base.\n\n{body}\n\n'
            "Use the search_knowledge and define_term tools as needed.")


def _explain(name: str, a: dict[str, str]) -> str:
    return (f'Explain the pattern "{a["pattern"]}" as documented in the {name} knowledge base.\n\nInclude:\n'
            "1. Definition from the lexicon\n2. How it works in practice\n3. Examples from the knowledge base\n"
            "4. Related patterns\n5. When to use vs. alternatives\n\n"
            "Use the search_knowledge and define_term tools to find accurate information.")


def _compare(name: str, a: dict[str, str]) -> str:
    return (f'Compare "{a["practice1"]}" and "{a["practice2"]}" as governance/coordination approaches, from the {name} '
            "knowledge base.\n\nStructure your comparison:\n1. Brief definition of each\n2. Key similarities\n"
            "3. Key differences\n4. When to use each\n5. How they might complement each other\n\n"
            "Use the search_knowledge tool to find relevant documentation for both.")


PROMPTS: list[Prompt] = [
    Prompt("research-topic", "Research a topic comprehensively across the knowledge base",
           [("topic", "Topic to research", True), ("depth", "Research depth: shallow or deep", False)], _research),
    Prompt("explain-pattern", "Explain a pattern with examples and context from the knowledge base",
           [("pattern", "Pattern name to explain", True)], _explain),
    Prompt("compare-practices", "Compare two governance or coordination practices",
           [("practice1", "First practice to compare", True), ("practice2", "Second practice to compare", True)],
           _compare),
]


def prompt_messages(name: str, kb_name: str, arguments: dict[str, str] | None) -> tuple[str, str]:
    """(description, user message text) of a prompt; InvalidInput for an unknown prompt or a missing argument."""
    prompt = next((p for p in PROMPTS if p.name == name), None)
    if prompt is None:
        raise InvalidInput(f"unknown prompt {name!r}", details={"prompts": [p.name for p in PROMPTS]})
    args = {k: v for k, v in (arguments or {}).items() if isinstance(v, str)}
    for arg, _, required in prompt.arguments:
        if required and not args.get(arg, "").strip():
            raise InvalidInput(f"prompt {name} needs the argument {arg!r}", details={"argument": arg})
    if name == "research-topic" and args.get("depth") not in (None, "", "shallow", "deep"):
        raise InvalidInput("depth must be shallow or deep", details={"argument": "depth"})
    return prompt.description, prompt.render(kb_name, args)


def resource_list(base: str) -> list[tuple[str, str, str, str]]:
    """(uri, name, description, mime type) of a knowledge base's resources; ``base`` is ``mcp://{org}/{kb}``."""
    return [
        (f"{base}/prompts/knowledge-search", "prompts/knowledge-search",
         "System prompt for searching this knowledge base", "text/plain"),
        (f"{base}/data/ontology", "data/ontology", "Content type hierarchy and metadata schema", "application/json"),
        (f"{base}/data/groups", "data/groups", "The groups of this knowledge base", "application/json"),
        (f"{base}/data/releases", "data/releases", "The releases of this knowledge base with their metadata",
         "application/json"),
    ]


async def read_resource(base: str, uri: str, reader: KnowledgeReader, ontology: dict[str, Any]) -> tuple[str, str]:
    """(mime type, text) of one resource; NotFound for a URI this knowledge base does not have."""
    if uri == f"{base}/prompts/knowledge-search":
        return "text/plain", search_prompt(reader.kb["name"])
    if uri == f"{base}/data/ontology":
        return "application/json", json.dumps(ontology_document(reader.kb, ontology), indent=2)
    if uri == f"{base}/data/groups":
        return "application/json", msgspec.json.encode(await reader.groups()).decode()
    if uri == f"{base}/data/releases":
        return "application/json", msgspec.json.encode(await reader.releases()).decode()
    raise NotFound(f"unknown resource {uri[:200]!r}")


# -- on the organization's own MCP URL -------------------------------------------------------------------------

_KB_ARG = {"knowledge_base": {"type": "string", "minLength": 1, "maxLength": 64,
                              "description": "the knowledge base's slug or id (optional when the organization has one)"}}


async def _reader_for(org: OrgServices, ref: str | None) -> tuple[Knowledge, KnowledgeReader]:
    ks = org.knowledge
    assert ks is not None
    if ref is None:
        rows = await ks.sql.rows("SELECT slug FROM knowledge_bases WHERE organization_id = ?1 ORDER BY slug LIMIT 101")
        if len(rows) != 1:
            raise InvalidInput("name a knowledge base: knowledge_base is its slug or id" if rows else
                               "this organization has no knowledge base", details={
                                   "field": "knowledge_base", "knowledge_bases": [r["slug"] for r in rows[:100]]})
        ref = rows[0]["slug"]
    return ks, await ks.reader(ref)


def _org_tool(tool: KbTool) -> McpTool:
    async def run(org: OrgServices, a: dict[str, Any]) -> dict[str, Any]:
        ks, reader = await _reader_for(org, a.get("knowledge_base"))
        data, _ = await tool.run(ks, reader, {k: v for k, v in a.items() if k != "knowledge_base"})
        return to_plain(data)

    return McpTool(tool.name, "read", tool.description + " (knowledge_base: which of the organization's knowledge bases)",
                   tool.input_schema(_KB_ARG), output_schema(tool.output), run)


async def _list_bases(org: OrgServices, a: dict[str, Any]) -> dict[str, Any]:
    assert org.knowledge is not None
    return to_plain(KnowledgeBaseChoices(await org.knowledge.bases.list()))


ORG_TOOLS: list[McpTool] = [
    McpTool("list_knowledge_bases", "read",
            "List this organization's knowledge bases (git-synced markdown vaults) with their sync state; the knowledge "
            "tools take one's slug as knowledge_base.",
            {"type": "object", "properties": {}, "required": [], "additionalProperties": False},
            output_schema(KnowledgeBaseChoices), _list_bases),
    *[_org_tool(t) for t in KB_TOOLS],
]
register_tools(ORG_TOOLS)
