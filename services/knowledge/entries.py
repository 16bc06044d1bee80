"""Reading one knowledge base: its entries, a whole document with its links, groups, releases and the lexicon.

``KnowledgeReader`` is bound to one organization's database and one knowledge base (its row). Links are stored as
written (``knowledge_links``: the target's id) and resolved when read, case-insensitively, so an entry added later
resolves the links that waited for it without touching the entries that point at it.
"""

from __future__ import annotations

import datetime
import json
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from services.errors import InvalidInput, NotFound
from services.knowledge.models import Document, EntryLink, EntryPage, EntrySummary, GroupInfo, ReleaseInfo, Term
from services.knowledge.ontology import CONTENT_TYPES, PARENT_TYPES
from services.storage.scoped import OrgSql

__all__ = ["KnowledgeReader", "Filters", "type_family", "normalize_term", "entry_summary", "parse_date", "term_of"]

#: Longest definition define_term returns (characters of the entry's description and body).
DEFINITION_CHARS = 4000


@dataclass(frozen=True, slots=True)
class Filters:
    """Filters on entries (REST query parameters, MCP arguments); None: any."""

    content_type: str | None = None
    group: str | None = None
    release: str | None = None
    status: str | None = None
    #: Any of these tags.
    tags: tuple[str, ...] = ()
    #: Epoch ms bounds (inclusive) on the entry's ``date``; an entry without a date is left out by either bound.
    date_from: int | None = None
    date_to: int | None = None

    def check(self) -> "Filters":
        if self.content_type is not None and self.content_type not in CONTENT_TYPES:
            raise InvalidInput(f"contentType must be one of {', '.join(CONTENT_TYPES)}",
                               details={"field": "contentType", "allowed": list(CONTENT_TYPES)})
        for name in ("group", "release", "status"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not 1 <= len(value) <= 200):
                raise InvalidInput(f"{name} must be 1-200 characters", details={"field": name})
        if len(self.tags) > 20 or any(not isinstance(t, str) or not 1 <= len(t) <= 100 for t in self.tags):
            raise InvalidInput("tags: at most 20 tags of 1-100 characters", details={"field": "tags"})
        if self.date_from is not None and self.date_to is not None and self.date_from > self.date_to:
            raise InvalidInput("dateFrom is after dateTo", details={"field": "dateFrom"})
        return self

    def sql(self, alias: str, first_param: int) -> tuple[str, list[Any]]:
        """``AND ...`` conditions on entries (``alias``), numbering parameters from ``first_param``."""
        conds: list[str] = []
        params: list[Any] = []

        def param(value: Any) -> str:
            params.append(value)
            return f"?{first_param + len(params) - 1}"

        if self.content_type:
            family = param(json.dumps(type_family(self.content_type)))
            conds.append(f"{alias}.content_type IN (SELECT value FROM json_each({family}))")
        for col, value in (("group_name", self.group), ("release", self.release), ("status", self.status)):
            if value is not None:
                conds.append(f"{alias}.{col} = {param(value)}")
        if self.tags:
            conds.append(f"EXISTS (SELECT 1 FROM json_each({alias}.tags) t WHERE t.value IN "
                         f"(SELECT value FROM json_each({param(json.dumps(list(self.tags)))})))")
        if self.date_from is not None:
            conds.append(f"{alias}.date >= {param(self.date_from)}")
        if self.date_to is not None:
            conds.append(f"{alias}.date <= {param(self.date_to)}")
        return "".join(" AND " + c for c in conds), params

    def vector_filter(self, kb_id: str) -> dict[str, Any]:
        """The same filters on the vector side (Vectorize metadata), except tags (applied in SQL: see
        services.search.indexing.KNOWLEDGE_FIELDS)."""
        flt: dict[str, Any] = {"kind": {"$eq": "knowledge"}, "kb": {"$eq": kb_id}}
        if self.content_type:
            family = type_family(self.content_type)
            flt["contentType"] = {"$eq": family[0]} if len(family) == 1 else {"$in": family}
        for key, value in (("group", self.group), ("release", self.release), ("status", self.status)):
            if value is not None:
                flt[key] = {"$eq": value}
        date: dict[str, int] = {}
        if self.date_from is not None:
            date["$gte"] = self.date_from
        if self.date_to is not None:
            date["$lte"] = self.date_to
        if date:
            flt["date"] = date
        return flt


#: The seed's parent types (§3.4): a filter on one of them also matches the types below it.
GROUPINGS = ("reference", "resource", "story", "data")


def type_family(content_type: str) -> list[str]:
    """A content type and the types below it: ``resource`` is also every pattern, practice, primitive...; a leaf
    type (and ``file``) is itself alone."""
    if content_type not in GROUPINGS:
        return [content_type]
    return [content_type, *[leaf for leaf, parent in PARENT_TYPES.items() if parent == content_type]]


def parse_date(value: Any, field: str) -> int | None:
    """Epoch ms of a date filter: an ISO-8601 date or date-time (no offset: UTC), or an integer of epoch ms."""
    if value is None or value == "":
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > 253_402_300_799_999:
            raise InvalidInput(f"{field} is out of range", details={"field": field})
        return value
    if isinstance(value, str) and len(value) <= 40:
        try:
            parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            parsed = None
        if parsed is not None:
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=datetime.timezone.utc)
            return int(parsed.timestamp() * 1000)
    raise InvalidInput(f"{field} must be an ISO-8601 date (2024-05-01) or epoch milliseconds", details={"field": field})


_NOT_WORD = re.compile(r"[\W_]+", re.UNICODE)


def normalize_term(text: str) -> str:
    """Case- and punctuation-insensitive form of a term: 'Cell-Governance!' == 'cell governance'."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(_NOT_WORD.sub(" ", folded).split())


def entry_summary(r: dict[str, Any]) -> EntrySummary:
    return EntrySummary(id=r["id"], content_type=r["content_type"], title=r["title"], path=r["path"],
                        description=r["description"], group=r["group_name"], release=r["release"], status=r["status"],
                        tags=json.loads(r["tags"] or "[]"), date=r["date"], synced_at=r["synced_at"])


_SUMMARY_COLUMNS = "uid, id, content_type, title, path, description, group_name, release, status, tags, date, synced_at"


class KnowledgeReader:
    def __init__(self, sql: OrgSql, kb: dict[str, Any]) -> None:
        self.sql = sql
        self.kb = kb
        self.kb_id: str = kb["id"]

    async def list_entries(self, filters: Filters, *, limit: int = 20, offset: int = 0) -> EntryPage:
        where, params = filters.check().sql("e", 3)
        rows = await self.sql.rows(
            f"SELECT {_SUMMARY_COLUMNS} FROM knowledge_entries e WHERE e.organization_id = ?1 AND e.kb_id = ?2{where} "
            f"ORDER BY e.content_type, e.id LIMIT {int(limit)} OFFSET {int(offset)}", [self.kb_id, *params])
        total = await self.sql.one(
            f"SELECT COUNT(*) AS n FROM knowledge_entries e WHERE e.organization_id = ?1 AND e.kb_id = ?2{where}",
            [self.kb_id, *params])
        return EntryPage(entries=[entry_summary(r) for r in rows], total=total["n"] if total else 0, limit=limit,
                         offset=offset)

    async def entry_row(self, content_type: str | None, entry_id: str) -> dict[str, Any]:
        if not isinstance(entry_id, str) or not 1 <= len(entry_id.encode("utf-8", "replace")) <= 64:
            raise NotFound("entry not found")
        row = await self.sql.one("SELECT * FROM knowledge_entries WHERE organization_id = ?1 AND kb_id = ?2 AND id = ?3",
                                 [self.kb_id, entry_id])
        if row is None or (content_type is not None and row["content_type"] != content_type):
            raise NotFound("entry not found", details={"contentType": content_type, "id": entry_id[:64]})
        return row

    async def document(self, content_type: str | None, entry_id: str) -> Document:
        return (await self.documents([await self.entry_row(content_type, entry_id)]))[0]

    async def documents(self, rows: list[dict[str, Any]]) -> list[Document]:
        """Whole documents for entry rows, with their outgoing links (resolved where an entry has the id) and
        incoming links."""
        if not rows:
            return []
        uids = json.dumps([r["uid"] for r in rows])
        names = json.dumps([r["id"] for r in rows] + [r["title"] for r in rows])
        # by id, else by title: two joins, one per index (an OR of the two would compare every link with every entry)
        out_links = await self.sql.rows(
            "SELECT l.source_uid, l.ordinal, l.target, l.label, i.id AS iid, i.content_type AS itype, i.title AS ititle, "
            "t.id AS tid, t.content_type AS ttype, t.title AS ttitle FROM knowledge_links l "
            "LEFT JOIN knowledge_entries i ON i.organization_id = l.organization_id AND i.kb_id = l.kb_id "
            "AND i.id = l.target COLLATE NOCASE "
            "LEFT JOIN knowledge_entries t ON t.organization_id = l.organization_id AND t.kb_id = l.kb_id "
            "AND t.title = l.target COLLATE NOCASE "
            "WHERE l.organization_id = ?1 AND l.source_uid IN (SELECT value FROM json_each(?2)) ORDER BY l.ordinal",
            [uids])
        in_links = await self.sql.rows(
            "SELECT l.target, l.label, s.id AS sid, s.content_type AS stype, s.title AS stitle "
            "FROM knowledge_links l JOIN knowledge_entries s ON s.organization_id = l.organization_id AND s.uid = l.source_uid "
            "WHERE l.organization_id = ?1 AND l.kb_id = ?2 AND l.target IN (SELECT value FROM json_each(?3)) "
            "ORDER BY s.id", [self.kb_id, names])
        ids_lower = {r["id"].casefold() for r in rows}
        docs = []
        for r in rows:
            docs.append(Document(id=r["id"], content_type=r["content_type"], path=r["path"], title=r["title"],
                                 metadata=json.loads(r["metadata"] or "{}"), content=r["body"], synced_at=r["synced_at"],
                                 commit_sha=r.get("commit_sha"), links=_outgoing(r, out_links),
                                 backlinks=_incoming(r, in_links, ids_lower),
                                 issues=[list(i) for i in json.loads(r["issues"] or "[]")]))
        return docs

    async def rows_by_ids(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        rows = await self.sql.rows("SELECT * FROM knowledge_entries WHERE organization_id = ?1 AND kb_id = ?2 "
                                   "AND id IN (SELECT value FROM json_each(?3))", [self.kb_id, json.dumps(ids)])
        return {r["id"]: r for r in rows}

    async def rows_by_uid(self, uids: list[str]) -> dict[str, dict[str, Any]]:
        # +kb_id: look the rows up by their key (uid), not by walking the knowledge base on another index
        rows = await self.sql.rows("SELECT * FROM knowledge_entries WHERE organization_id = ?1 AND +kb_id = ?2 "
                                   "AND uid IN (SELECT value FROM json_each(?3))", [self.kb_id, json.dumps(uids)])
        return {r["uid"]: r for r in rows}

    # -- groups and releases ---------------------------------------------------------------------------

    async def groups(self) -> list[GroupInfo]:
        counts = await self.sql.rows(
            "SELECT group_name AS g, COUNT(*) AS n FROM knowledge_entries WHERE organization_id = ?1 AND kb_id = ?2 "
            "AND group_name IS NOT NULL GROUP BY group_name ORDER BY group_name", [self.kb_id])
        profiles = {normalize_term(r["id"]): r for r in await self.sql.rows(
            "SELECT id, title, description, metadata FROM knowledge_entries WHERE organization_id = ?1 AND kb_id = ?2 "
            "AND content_type = 'group'", [self.kb_id])}
        for r in list(profiles.values()):  # a group entry names its group by its slug, else its id
            slug = json.loads(r["metadata"] or "{}").get("slug")
            if isinstance(slug, str):
                profiles.setdefault(normalize_term(slug), r)
        out = []
        for c in counts:
            p = profiles.get(normalize_term(c["g"]))
            out.append(GroupInfo(group=c["g"], entries=c["n"], id=p["id"] if p else None, title=p["title"] if p else None,
                                 description=p["description"] if p else None))
        return out

    async def releases(self) -> list[ReleaseInfo]:
        """Folders holding an ``index.base``, identified by their ``index.md`` (its entry id is the folder's name)."""
        folders = [r["path"].rpartition("/")[0] for r in await self.sql.rows(
            "SELECT path FROM knowledge_files WHERE organization_id = ?1 AND kb_id = ?2 AND outcome = 'marker' "
            "ORDER BY path", [self.kb_id])]
        folders = [f for f in folders if f]
        if not folders:
            return []
        index_rows = {r["path"]: r for r in await self.sql.rows(
            "SELECT path, title, description, date FROM knowledge_entries WHERE organization_id = ?1 AND kb_id = ?2 "
            "AND path IN (SELECT value FROM json_each(?3))", [self.kb_id, json.dumps([f + "/index.md" for f in folders])])}
        counts = {r["release"]: r["n"] for r in await self.sql.rows(
            "SELECT release, COUNT(*) AS n FROM knowledge_entries WHERE organization_id = ?1 AND kb_id = ?2 "
            "AND release IS NOT NULL GROUP BY release", [self.kb_id])}
        out = []
        for folder in folders:
            rid = folder.rpartition("/")[2]
            idx = index_rows.get(folder + "/index.md")
            parent = next((f.rpartition("/")[2] for f in sorted(folders, key=len, reverse=True)
                           if f != folder and folder.startswith(f + "/")), None)
            out.append(ReleaseInfo(id=rid, path=folder, title=idx["title"] if idx else rid, entries=counts.get(rid, 0),
                                   description=idx["description"] if idx else None, date=idx["date"] if idx else None,
                                   parent=parent))
        return out

    # -- the lexicon -----------------------------------------------------------------------------------

    async def _tags(self) -> list[dict[str, Any]]:
        return await self.sql.rows(
            "SELECT uid, id, title, description, body, metadata FROM knowledge_entries WHERE organization_id = ?1 "
            "AND kb_id = ?2 AND content_type = 'tag' ORDER BY id", [self.kb_id])

    async def define_term(self, term: str) -> Term | None:
        """The ``tag`` entry whose title, id or one of whose aliases is ``term``, ignoring case and punctuation."""
        wanted = normalize_term(term or "")
        if not wanted:
            raise InvalidInput("term must contain a letter or a digit", details={"field": "term"})
        rows = await self._tags()
        for keys in (lambda r: [r["title"]], lambda r: [r["id"]], lambda r: _aliases(r)):
            for r in rows:
                if any(normalize_term(k) == wanted for k in keys(r)):
                    return term_of(r)
        return None


def _outgoing(entry: dict[str, Any], links: list[dict[str, Any]]) -> list[EntryLink]:
    """An entry's links in order, each resolved to the entry with that id, else with that title (any case)."""
    best: dict[int, EntryLink] = {}
    for x in links:
        if x["source_uid"] != entry["uid"] or (x["ordinal"] in best and best[x["ordinal"]].resolved):
            continue
        key = "i" if x["iid"] is not None else "t"
        found = x[f"{key}id"]
        best[x["ordinal"]] = EntryLink(id=found or x["target"], label=x["label"], resolved=found is not None,
                                       content_type=x[f"{key}type"], title=x[f"{key}title"])
    return [link for _, link in sorted(best.items())]


def _incoming(entry: dict[str, Any], links: list[dict[str, Any]], ids: set[str]) -> list[EntryLink]:
    """The entries linking to ``entry`` by its id, or by its title when no entry has that title as its id."""
    names = {entry["id"].casefold()}
    if entry["title"].casefold() not in ids:
        names.add(entry["title"].casefold())
    seen: set[str] = set()
    out = []
    for x in links:
        if x["target"].casefold() in names and x["sid"] not in seen:
            seen.add(x["sid"])
            out.append(EntryLink(id=x["sid"], label=x["label"], content_type=x["stype"], title=x["stitle"]))
    return out


def _aliases(row: dict[str, Any]) -> list[str]:
    aliases = json.loads(row["metadata"] or "{}").get("aliases") or []
    return [a for a in aliases if isinstance(a, str)]


def term_of(row: dict[str, Any]) -> Term:
    meta = json.loads(row["metadata"] or "{}")
    parts = [p for p in (row["description"], (row["body"] or "").strip()) if p]
    definition = "\n\n".join(parts)
    if len(definition) > DEFINITION_CHARS:
        definition = definition[:DEFINITION_CHARS].rsplit(" ", 1)[0] + "…"
    related = meta.get("relatedTerms") or []
    return Term(id=row["id"], title=row["title"], definition=definition or row["title"],
                aliases=_aliases(row), related_terms=[t for t in related if isinstance(t, str)])
