"""Knowledge bases of one organization: create, read, change, delete, and ask for syncs.

A knowledge base lives in the organization's own database; the control database only routes GitHub's
webhook (``knowledge_base_routes``: the URL names the knowledge base, not the organization). ``{kb}``
everywhere is the slug or the id. A git source's token and the webhook secret are stored, never returned
(the secret is shown once: at creation and on rotation).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.errors import Conflict, InvalidInput, NotFound
from services.ids import now_ms
from services.knowledge.models import (
    FileError, FileWarning, KnowledgeBase, SourceOut, Sync, SyncCounts, UnresolvedLink,
)
from services.knowledge.ontology import Ontology
from services.knowledge.markdown import MAX_FILE_BYTES
from services.knowledge.archive import read_archive
from services.knowledge.paths import DEFAULT_EXCLUDE, DEFAULT_INCLUDE, check_globs, excluded, is_marker, selected
from services.search.indexing import KB_EMBED_JOB
from services.storage.scoped import OrgSql
from services.knowledge.gitsource import check_source_url

__all__ = ["KnowledgeBases", "SourcePolicy", "SYNC_JOB", "VISIBILITIES", "TIERS", "TIER_LEVEL",
           "SLUG", "enqueue_sync"]

#: The job that runs a sync (target: the sync id) and the one that embeds pending knowledge chunks (target '*').
SYNC_JOB = "kb_sync"
VISIBILITIES = ("private", "open", "public", "members")
TIERS = ("open", "public", "members")
TIER_LEVEL = {"open": 0, "public": 1, "members": 2}
SLUG = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$")
MAX_KNOWLEDGE_BASES = 100
#: Errors, warnings and skips shown in one sync's detail (the counts are always whole).
DETAIL_LIMIT = 1000
#: Uploaded files staged per batch.
UPLOAD_BATCH = 50


@dataclass(frozen=True)
class SourcePolicy:
    """Which git sources this deployment accepts (MEMEX_KB_LOCAL_ROOTS, MEMEX_KB_ALLOW_HTTP)."""

    local_roots: tuple[str, ...] = ()
    allow_http: bool = False


def enqueue_sync(sql: OrgSql, sync_id: str, now: int, run_after: int | None = None):
    return sql.stmt(
        "INSERT INTO jobs (organization_id, kind, target_id, run_after, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
        SYNC_JOB, sync_id, run_after if run_after is not None else now, now)


@dataclass
class KnowledgeBases:
    sql: OrgSql
    #: The control database bound to the organization (the webhook routes).
    control: OrgSql
    policy: SourcePolicy = field(default_factory=SourcePolicy)
    on_enqueue: Callable[[], None] = lambda: None

    # -- reading ---------------------------------------------------------------------------------------

    async def row(self, ref: str) -> dict[str, Any]:
        """The knowledge base named by slug or id (NotFound otherwise)."""
        if not isinstance(ref, str) or not ref or len(ref) > 64:
            raise NotFound("knowledge base not found")
        row = await self.sql.one(
            "SELECT * FROM knowledge_bases WHERE organization_id = ?1 AND (id = ?2 OR slug = ?2)", [ref])
        if row is None:
            raise NotFound("knowledge base not found")
        return row

    async def get(self, ref: str) -> KnowledgeBase:
        return await self.view(await self.row(ref))

    async def list(self) -> list[KnowledgeBase]:
        rows = await self.sql.rows("SELECT * FROM knowledge_bases WHERE organization_id = ?1 ORDER BY created_at, id")
        return [await self.view(r) for r in rows]

    async def view(self, row: dict[str, Any]) -> KnowledgeBase:
        counts = await self.sql.one(
            "SELECT (SELECT COUNT(*) FROM knowledge_entries WHERE organization_id = ?1 AND kb_id = ?2) AS entries, "
            "COUNT(c.pk) AS chunks, COALESCE(SUM(c.indexed_at IS NOT NULL AND c.vector_mutation IS NULL), 0) AS searchable "
            "FROM knowledge_entries e JOIN chunks c ON c.organization_id = e.organization_id AND c.kind = 'knowledge' "
            "AND c.parent_id = e.uid WHERE e.organization_id = ?1 AND e.kb_id = ?2", [row["id"]]) or {}
        latest = await self.sql.one(
            "SELECT id FROM knowledge_syncs WHERE organization_id = ?1 AND kb_id = ?2 ORDER BY created_at DESC, id DESC "
            "LIMIT 1", [row["id"]])
        last = await self.sync(row, latest["id"], detail=False) if latest is not None else None
        src = json.loads(row["source"])
        slug = row["slug"]
        org_slug = await self._org_slug()
        return KnowledgeBase(
            id=row["id"], slug=slug, name=row["name"], visibility=row["visibility"], document_tier=row["document_tier"],
            source=SourceOut(type=src["type"], url=src.get("url"), branch=src.get("branch"), include=src.get("include"),
                             exclude=src.get("exclude"), has_token=bool(row["source_token"])),
            ontology=Ontology.from_json(json.loads(row["ontology"] or "{}")).to_json(),
            entries=counts.get("entries") or 0, chunks=counts.get("chunks") or 0,
            chunks_searchable=counts.get("searchable") or 0, last_commit=row["last_commit"],
            last_synced_at=row["last_synced_at"], last_sync=last, created_at=row["created_at"], updated_at=row["updated_at"],
            webhook_path=f"/hooks/github/{row['id']}", mcp_path=f"/kb/{org_slug}/{slug}/mcp",
            api_path=f"/kb/{org_slug}/{slug}/api/v1",
        )

    async def _org_slug(self) -> str:
        row = await self.control.one("SELECT slug FROM organizations WHERE id = ?1")
        return row["slug"] if row else self.sql.org_id

    # -- writing ---------------------------------------------------------------------------------------

    def _source(self, src: dict[str, Any], *, check_url: bool = True) -> tuple[dict[str, Any], str | None]:
        kind = src.get("type")
        if kind == "upload":
            extra = set(src) - {"type", "include", "exclude"}
            if extra:
                raise InvalidInput(f"an upload source takes no {sorted(extra)[0]!r}", details={"field": "source"})
            return {"type": "upload", "include": list(check_globs(src.get("include", DEFAULT_INCLUDE), "source.include")),
                    "exclude": list(check_globs(src.get("exclude", DEFAULT_EXCLUDE), "source.exclude"))}, None
        if kind != "git":
            raise InvalidInput("source.type must be 'git' or 'upload'", details={"field": "source.type"})
        url = src.get("url")
        if not isinstance(url, str):
            raise InvalidInput("source.url is required for a git source", details={"field": "source.url"})
        if check_url:  # a stored url stands as it was accepted (by the operator's CLI, say)
            url = check_source_url(url, local_roots=self.policy.local_roots, allow_http=self.policy.allow_http)
        branch = src.get("branch", "main")
        if not isinstance(branch, str) or not re.fullmatch(r"[\w./-]{1,200}", branch) or ".." in branch:
            raise InvalidInput("source.branch must be a branch name", details={"field": "source.branch"})
        token = src.get("token")
        if token is not None and (not isinstance(token, str) or not 1 <= len(token) <= 1000):
            raise InvalidInput("source.token must be a string of 1-1000 characters", details={"field": "source.token"})
        return {"type": "git", "url": url, "branch": branch,
                "include": list(check_globs(src.get("include", DEFAULT_INCLUDE), "source.include")),
                "exclude": list(check_globs(src.get("exclude", DEFAULT_EXCLUDE), "source.exclude"))}, token

    async def create(self, *, slug: str, name: str | None, visibility: str, document_tier: str,
                     source: dict[str, Any], ontology: dict[str, Any] | None, sync: bool = True
                     ) -> tuple[dict[str, Any], str, str | None]:
        """Returns (row, webhook secret, the first sync's id or None)."""
        if not SLUG.match(slug or ""):
            raise InvalidInput("slug: 1-64 of a-z, 0-9 and '-', starting and ending with a letter or digit",
                               details={"field": "slug"})
        _check_choice(visibility, VISIBILITIES, "visibility")
        _check_choice(document_tier, TIERS, "document_tier")
        src, token = self._source(source)
        ont = Ontology.from_json(ontology)
        count = await self.sql.one("SELECT COUNT(*) AS n FROM knowledge_bases WHERE organization_id = ?1")
        if count and count["n"] >= MAX_KNOWLEDGE_BASES:
            raise Conflict(f"an organization has at most {MAX_KNOWLEDGE_BASES} knowledge bases",
                           details={"limit": MAX_KNOWLEDGE_BASES})
        kb_id = "kb_" + secrets.token_hex(8)
        secret = secrets.token_urlsafe(32)
        now = now_ms()
        await self.control.execute(
            "INSERT INTO knowledge_base_routes (id, organization_id, created_at) VALUES (?2, ?1, ?3)", [kb_id, now])
        stmts = [self.sql.stmt(
            "INSERT INTO knowledge_bases (organization_id, id, slug, name, visibility, document_tier, source, source_token, "
            "ontology, webhook_secret, created_at, updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?11) "
            "ON CONFLICT (organization_id, slug) DO NOTHING",
            kb_id, slug, name or slug, visibility, document_tier, json.dumps(src), token, json.dumps(ont.to_json()),
            secret, now)]
        sync_id = None
        if sync and src["type"] == "git":
            sync_id = _sync_id()
            stmts += [self.sql.stmt(
                "INSERT INTO knowledge_syncs (organization_id, id, kb_id, trigger, created_at) SELECT ?1, ?2, ?3, 'api', ?4 "
                "WHERE EXISTS (SELECT 1 FROM knowledge_bases WHERE organization_id = ?1 AND id = ?3)", sync_id, kb_id, now),
                self.sql.stmt(
                "INSERT INTO jobs (organization_id, kind, target_id, run_after, created_at) SELECT ?1, ?2, ?3, ?4, ?4 "
                "WHERE EXISTS (SELECT 1 FROM knowledge_syncs WHERE organization_id = ?1 AND id = ?3)", SYNC_JOB, sync_id, now)]
        res = await self.sql.batch(stmts)
        if res[0].changes == 0:
            await self.control.execute("DELETE FROM knowledge_base_routes WHERE organization_id = ?1 AND id = ?2", [kb_id])
            raise Conflict("a knowledge base with this slug already exists", details={"field": "slug"})
        if sync_id:
            self.on_enqueue()
        return await self.row(kb_id), secret, sync_id

    async def update(self, ref: str, patch: dict[str, Any]) -> dict[str, Any]:
        row = await self.row(ref)
        sets: dict[str, Any] = {}
        if "name" in patch:
            sets["name"] = patch["name"]
        if "slug" in patch and patch["slug"] != row["slug"]:
            if not SLUG.match(patch["slug"] or ""):
                raise InvalidInput("slug: 1-64 of a-z, 0-9 and '-'", details={"field": "slug"})
            sets["slug"] = patch["slug"]
        if "visibility" in patch:
            sets["visibility"] = _check_choice(patch["visibility"], VISIBILITIES, "visibility")
        if "document_tier" in patch:
            sets["document_tier"] = _check_choice(patch["document_tier"], TIERS, "document_tier")
        if "ontology" in patch:  # the given keys over the current ontology
            current = json.loads(row["ontology"] or "{}")
            sets["ontology"] = json.dumps(Ontology.from_json({**current, **(patch["ontology"] or {})}).to_json())
        if "source" in patch:
            old = json.loads(row["source"])
            new = dict(patch["source"])
            if new.get("type", old["type"]) != old["type"]:
                raise InvalidInput("a knowledge base keeps its source type; create another one",
                                   details={"field": "source.type"})
            merged = {k: v for k, v in old.items()}
            merged.update(new)
            keep_token = "token" not in new
            src, token = self._source({k: v for k, v in merged.items() if k != "has_token"},
                                      check_url=new.get("url", old.get("url")) != old.get("url"))
            sets["source"] = json.dumps(src)
            if not keep_token:
                sets["source_token"] = token
        if not sets:
            return row
        sets["updated_at"] = now_ms()
        cols = list(sets)
        assign = ", ".join(f"{c} = ?{i + 3}" for i, c in enumerate(cols))
        try:
            await self.sql.execute(f"UPDATE knowledge_bases SET {assign} WHERE organization_id = ?1 AND id = ?2",
                                   [row["id"], *[sets[c] for c in cols]])
        except Exception as exc:  # the slug's unique constraint
            if "UNIQUE" in str(exc).upper():
                raise Conflict("a knowledge base with this slug already exists", details={"field": "slug"}) from None
            raise
        return await self.row(row["id"])

    async def rotate_secret(self, ref: str) -> tuple[dict[str, Any], str]:
        row = await self.row(ref)
        secret = secrets.token_urlsafe(32)
        await self.sql.execute("UPDATE knowledge_bases SET webhook_secret = ?3, updated_at = ?4 "
                               "WHERE organization_id = ?1 AND id = ?2", [row["id"], secret, now_ms()])
        return await self.row(row["id"]), secret

    async def delete(self, ref: str) -> str:
        """Delete the knowledge base's rows (entries, chunks, links, files, syncs, uploads, deliveries, jobs) in one
        batch, then its route. The entries' chunks leave their ids in ``vector_gc`` in the same batch (migration
        0002's trigger): the caller deletes those vectors next (rows first, vectors after, as
        services.search.indexing.drop_vanished requires). Returns its id."""
        row = await self.row(ref)
        kb_id = row["id"]
        syncs = "(SELECT id FROM knowledge_syncs WHERE organization_id = ?1 AND kb_id = ?2)"
        await self.sql.batch([
            self.sql.stmt(f"DELETE FROM jobs WHERE organization_id = ?1 AND kind = '{SYNC_JOB}' AND target_id IN {syncs}",
                          kb_id),
            self.sql.stmt(f"DELETE FROM jobs WHERE organization_id = ?1 AND kind = '{KB_EMBED_JOB}' AND target_id = ?2",
                          kb_id),
            self.sql.stmt(f"DELETE FROM knowledge_uploads WHERE organization_id = ?1 AND sync_id IN {syncs}", kb_id),
            self.sql.stmt(f"DELETE FROM knowledge_sync_files WHERE organization_id = ?1 AND sync_id IN {syncs}", kb_id),
            self.sql.stmt("DELETE FROM knowledge_syncs WHERE organization_id = ?1 AND kb_id = ?2", kb_id),
            self.sql.stmt("DELETE FROM knowledge_entries WHERE organization_id = ?1 AND kb_id = ?2", kb_id),
            self.sql.stmt("DELETE FROM knowledge_links WHERE organization_id = ?1 AND kb_id = ?2", kb_id),
            self.sql.stmt("DELETE FROM knowledge_files WHERE organization_id = ?1 AND kb_id = ?2", kb_id),
            self.sql.stmt("DELETE FROM knowledge_deliveries WHERE organization_id = ?1 AND kb_id = ?2", kb_id),
            self.sql.stmt("DELETE FROM knowledge_bases WHERE organization_id = ?1 AND id = ?2", kb_id),
        ])
        await self.control.execute("DELETE FROM knowledge_base_routes WHERE organization_id = ?1 AND id = ?2", [kb_id])
        return kb_id

    # -- syncs -----------------------------------------------------------------------------------------

    async def request_sync(self, row: dict[str, Any], trigger: str, *, delivery_id: str | None = None,
                           files: dict[str, bytes] | None = None, full: bool = False) -> tuple[str, bool]:
        """Queue a sync of the knowledge base; returns (sync id, created). A sync already queued (not yet
        running) for it is reused rather than a second queued (an upload always gets its own: it carries
        files). ``files``: an uploaded vault (staged until the sync applies it; a file larger than an entry may be
        is staged without its bytes, to be reported by the sync). ``full``: compare every file, not only what
        git says changed."""
        src = json.loads(row["source"])
        if files is None and src["type"] != "git":
            raise InvalidInput("this knowledge base is filled by uploads: POST its import with an archive",
                               details={"source": "upload"})
        if files is not None and src["type"] != "upload":
            raise Conflict("this knowledge base syncs from git: push to its repository, or create an upload knowledge "
                           "base for archives", details={"source": "git"})
        now = now_ms()
        if files is None:
            queued = await self.sql.one(
                "SELECT id FROM knowledge_syncs WHERE organization_id = ?1 AND kb_id = ?2 AND state = 'queued' "
                "AND trigger != 'import' ORDER BY created_at DESC LIMIT 1", [row["id"]])
            if queued is not None:
                if full:
                    await self.sql.execute("UPDATE knowledge_syncs SET full = 1 WHERE organization_id = ?1 AND id = ?2",
                                           [queued["id"]])
                if delivery_id:
                    await self._delivery(row["id"], delivery_id, queued["id"], now)
                return queued["id"], False
        sync_id = _sync_id()
        # An upload's files go first, in batches; the sync row and its job last, in one batch: until then no
        # sync exists, so a refused or interrupted upload applies nothing.
        staged = [self.sql.stmt(
            "INSERT INTO knowledge_uploads (organization_id, sync_id, path, content, size, sha256) "
            "VALUES (?1, ?2, ?3, ?4, ?5, ?6)", sync_id, path,
            base64.b64encode(content).decode() if len(content) <= MAX_FILE_BYTES else None, len(content),
            hashlib.sha256(content).hexdigest()) for path, content in sorted((files or {}).items())]
        for i in range(0, len(staged), UPLOAD_BATCH):
            await self.sql.batch(staged[i:i + UPLOAD_BATCH])
        await self.sql.batch([self.sql.stmt(
            "INSERT INTO knowledge_syncs (organization_id, id, kb_id, trigger, delivery_id, full, created_at) "
            "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)", sync_id, row["id"], trigger, delivery_id, int(full), now),
            enqueue_sync(self.sql, sync_id, now)])
        if delivery_id:
            await self._delivery(row["id"], delivery_id, sync_id, now)
        self.on_enqueue()
        return sync_id, True

    async def import_archive(self, row: dict[str, Any], data: bytes, trigger: str = "import") -> str:
        """Queue an upload knowledge base's sync of an archive (.zip, .tar.gz), checked whole first
        (services.knowledge.archive: refused with 400/413 and nothing staged); its markdown files the globs select and
        its release markers are kept. Returns the sync id."""
        src = json.loads(row["source"])
        if src["type"] != "upload":
            raise Conflict("this knowledge base syncs from git: push to its repository, or create an upload knowledge "
                           "base for archives", details={"source": "git"})
        if not data:
            raise InvalidInput("send the archive as the request body (application/zip or application/gzip)",
                               details={"field": "body"})
        ontology = Ontology.from_json(json.loads(row["ontology"] or "{}"))
        keep_top = {"docs", "data", "drafts"} | {prefix.partition("/")[0] for prefix in ontology.path_types}
        files = await asyncio.to_thread(read_archive, data, keep_top=keep_top)
        kept = {p: body for p, body in files.items()
                if selected(p, src["include"], src["exclude"]) or (is_marker(p) and not excluded(p, src["exclude"]))}
        sync_id, _ = await self.request_sync(row, trigger, files=kept)
        return sync_id

    async def seen_delivery(self, kb_id: str, delivery_id: str) -> str | None:
        """The sync a webhook delivery already queued ('' when it queued none), None when it is new."""
        r = await self.sql.one("SELECT sync_id FROM knowledge_deliveries WHERE organization_id = ?1 AND kb_id = ?2 "
                               "AND delivery_id = ?3", [kb_id, delivery_id])
        return None if r is None else (r["sync_id"] or "")

    async def _delivery(self, kb_id: str, delivery_id: str, sync_id: str | None, now: int) -> None:
        await self.sql.execute(
            "INSERT INTO knowledge_deliveries (organization_id, kb_id, delivery_id, sync_id, created_at) "
            "VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT DO NOTHING", [kb_id, delivery_id, sync_id, now])

    async def record_delivery(self, kb_id: str, delivery_id: str) -> None:
        await self._delivery(kb_id, delivery_id, None, now_ms())

    async def syncs(self, row: dict[str, Any], limit: int = 20) -> list[Sync]:
        ids = await self.sql.rows("SELECT id FROM knowledge_syncs WHERE organization_id = ?1 AND kb_id = ?2 "
                                  "ORDER BY created_at DESC, id DESC LIMIT ?3", [row["id"], limit])
        return [s for s in [await self.sync(row, r["id"], detail=False) for r in ids] if s is not None]

    async def sync(self, row: dict[str, Any], sync_id: str, *, detail: bool = True) -> Sync:
        s = await self.sql.one("SELECT * FROM knowledge_syncs WHERE organization_id = ?1 AND kb_id = ?2 AND id = ?3",
                               [row["id"], sync_id])
        if s is None:
            raise NotFound("sync not found")
        counts = SyncCounts(unchanged=s["unchanged"])
        done = 0
        for r in await self.sql.rows("SELECT outcome, COUNT(*) AS n FROM knowledge_sync_files WHERE organization_id = ?1 "
                                     "AND sync_id = ?2 GROUP BY outcome", [sync_id]):
            done += r["n"]
            if hasattr(counts, r["outcome"]):
                setattr(counts, r["outcome"], getattr(counts, r["outcome"]) + r["n"])
        out = Sync(id=s["id"], knowledge_base_id=s["kb_id"], state=s["state"], trigger=s["trigger"], mode=s["mode"],
                   commit=s["commit_sha"], base_commit=s["base_commit"], counts=counts, files_total=s["files_total"],
                   files_done=done, created_at=s["created_at"], started_at=s["started_at"], finished_at=s["finished_at"],
                   error=s["error"])
        if detail:
            rows = await self.sql.rows(
                "SELECT path, outcome, reason, warnings FROM knowledge_sync_files WHERE organization_id = ?1 AND sync_id = ?2 "
                "AND (outcome IN ('failed', 'skipped') OR warnings IS NOT NULL) ORDER BY path LIMIT ?3",
                [sync_id, DETAIL_LIMIT * 3])
            out.errors = [FileError(r["path"], r["reason"] or "") for r in rows if r["outcome"] == "failed"][:DETAIL_LIMIT]
            out.skipped = [FileError(r["path"], r["reason"] or "") for r in rows if r["outcome"] == "skipped"][:DETAIL_LIMIT]
            out.warnings = [FileWarning(r["path"], f, why) for r in rows if r["warnings"]
                            for f, why in json.loads(r["warnings"])][:DETAIL_LIMIT]
            out.unresolved_links = [UnresolvedLink(**u) for u in json.loads(s["unresolved_links"] or "[]")]
        return out


def _sync_id() -> str:
    return "ks_" + secrets.token_hex(8)


def _check_choice(value: object, allowed: Sequence[str], field_name: str) -> str:
    if value not in allowed:
        raise InvalidInput(f"{field_name} must be one of {', '.join(allowed)}", details={"field": field_name})
    return str(value)
