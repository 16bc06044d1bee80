"""Test helpers for published knowledge bases: one organization holding a knowledge base of each visibility and
document tier, all synced over git from the fixture vault (tests/kb_vault.py), and the callers the tier rules
tell apart (no credential, another organization's key, one of the owner's read keys, a revoked key)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import Live, Org, backend_live, signup
from tests.kb_vault import GitVault, vault_files

__all__ = ["KBS", "OPEN_CACHE", "PRIVATE_CACHE", "Published", "published_kbs", "create_kb", "wait_synced", "make_key",
           "git_vault"]

#: slug -> (visibility, document_tier). The first four are the tier matrix's open / public / members / private.
KBS: dict[str, tuple[str, str]] = {
    "coop": ("open", "members"),
    "pub": ("public", "members"),
    "mem": ("members", "members"),
    "priv": ("private", "members"),
    "opendocs": ("open", "open"),
    "pubdocs": ("open", "public"),
}
OPEN_CACHE = "public, max-age=300, stale-while-revalidate=3600"
PRIVATE_CACHE = "private, no-cache"


def git_vault(path: Path, files: dict[str, bytes] | None = None) -> GitVault:
    """A git repository at ``path`` holding ``files`` (the fixture vault by default), committed."""
    vault = GitVault(path)
    vault.write(vault_files() if files is None else files)
    vault.commit("the vault")
    return vault


def create_kb(client: httpx.Client, org: Org, slug: str, url: str, *, visibility: str = "private",
              document_tier: str = "members", branch: str = "main") -> dict[str, Any]:
    """A knowledge base synced from the git repository at ``url`` (its first sync queued); the creation answer."""
    r = client.post("/v1/knowledge-bases", headers=org.headers, json={
        "slug": slug, "visibility": visibility, "document_tier": document_tier,
        "source": {"type": "git", "url": url, "branch": branch}})
    assert r.status_code == 201, r.text
    return r.json()


def wait_synced(client: httpx.Client, org: Org, slugs, *, state: str = "succeeded",
                timeout: float = 90.0) -> dict[str, dict[str, Any]]:
    """Poll each knowledge base until its last sync reached ``state`` and (when it succeeded) every chunk is
    searchable; returns slug -> the knowledge base as GET shows it."""
    deadline = time.monotonic() + timeout
    out: dict[str, dict[str, Any]] = {}
    for slug in slugs:
        while True:
            kb = client.get(f"/v1/knowledge-bases/{slug}", headers=org.headers).json()
            last = kb["last_sync"] or {}
            done = last.get("state") == state and (state != "succeeded" or kb["chunks"] == kb["chunks_searchable"] > 0)
            if done:
                out[slug] = kb
                break
            assert last.get("state") not in ({"succeeded", "failed"} - {state}), (slug, last)
            assert time.monotonic() < deadline, f"{slug} did not reach {state}: {kb}"
            time.sleep(0.1)
    return out


def make_key(client: httpx.Client, org: Org, scopes: list[str]) -> tuple[str, dict[str, str]]:
    """A new key of ``org``: (its id, request headers carrying it)."""
    r = client.post("/v1/keys", json={"name": "-".join(scopes), "scopes": scopes}, headers=org.headers)
    assert r.status_code == 201, r.text
    return r.json()["id"], {"authorization": f"Bearer {r.json()['key']}"}


@dataclass
class Published:
    live: Live
    #: The owner (its admin key), another organization, and the owner's read-only and revoked keys.
    org: Org
    other: Org
    member: dict[str, str]
    revoked: dict[str, str]
    #: slug -> the knowledge base as GET /v1/knowledge-bases/{slug} showed it once synced.
    kbs: dict[str, dict[str, Any]] = field(default_factory=dict)
    vault: Path | None = None

    @property
    def callers(self) -> dict[str, dict[str, str]]:
        return {"anonymous": {}, "other": self.other.headers, "member": self.member, "revoked": self.revoked}

    def api(self, kb: str, path: str = "") -> str:
        return f"/kb/{self.org.slug}/{kb}/api/v1{path}"

    def mcp_url(self, kb: str) -> str:
        return f"{self.live.base_url}/kb/{self.org.slug}/{kb}/mcp"


@contextmanager
def published_kbs(backend: str, tmp: Path, *, embedder: str = "hash", kbs: dict[str, tuple[str, str]] = KBS,
                  **settings: Any) -> Iterator[Published]:
    """The service on ``backend`` with ``kbs`` created from the fixture vault and synced."""
    settings.setdefault("kb_public_rate_per_minute", 100_000)
    with backend_live(backend, tmp, embedder=embedder, kb_local_roots=[str(tmp / "vaults")], **settings) as live:
        vault = git_vault(tmp / "vaults" / "coop")
        org, other = signup(live, "kb-owner"), signup(live, "kb-other")
        with live.client() as c:
            _, member = make_key(c, org, ["read"])
            revoked_id, revoked = make_key(c, org, ["read"])
            assert c.delete(f"/v1/keys/{revoked_id}", headers=org.headers).status_code == 204
            for slug, (visibility, tier) in kbs.items():
                create_kb(c, org, slug, str(vault.path), visibility=visibility, document_tier=tier)
            synced = wait_synced(c, org, kbs)
        try:
            yield Published(live, org, other, member, revoked, synced, vault.path)
        finally:
            vault.close()
