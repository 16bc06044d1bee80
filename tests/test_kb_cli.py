"""``memex kb create | sync | import | list | status`` run as the operator runs them: ``python -m api.cli`` in a
subprocess, on a temporary data directory, with the hash embedder (no model) and git repositories built by
tests.kb_vault (dulwich only). The counts expected come from the fixture vault's PROBLEM_FILES."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.kb_vault import PROBLEM_FILES, TYPES_BY_ID, UNRESOLVED_LINKS, GitVault, vault_files

ROOT = Path(__file__).resolve().parents[1]
ORG = "shelf-co"
#: What a sync of the fixture vault makes of its markdown files (drafts/ and dot-folders are never read).
READ = sorted(p for p in vault_files() if p.endswith(".md") and PROBLEM_FILES.get(p) not in ("drafts_folder", "dot_folder"))
SKIPPED = sorted(p for p, why in PROBLEM_FILES.items() if why in ("unpublished", "no_publish", "draft"))
#: Refused files: unreadable ones, and the duplicate id's later holders (files are applied in path order).
FAILED = [p for p, why in PROBLEM_FILES.items() if why in ("malformed_yaml", "not_utf8", "too_large")] + sorted(
    p for p, why in PROBLEM_FILES.items() if why == "duplicate_id")[1:]
ADDED = len(READ) - len(SKIPPED) - len(FAILED)


def memex(data_dir: Path, *args: str, code: int = 0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``memex ARGS --json --data-dir DATA_DIR`` with the hash embedder, progress bars drawn though stderr is no
    terminal (MEMEX_PROGRESS=always), and no other MEMEX_* setting of the caller."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMEX_")}
    out = subprocess.run([sys.executable, "-m", "api.cli", *args, "--json", "--data-dir", str(data_dir)],
                         capture_output=True, text=True, cwd=ROOT,
                         env={**clean, "MEMEX_EMBEDDER": "hash", "MEMEX_PROGRESS": "always", **(env or {})}, timeout=120)
    assert out.returncode == code, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


def as_json(out: subprocess.CompletedProcess):
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def shelf(tmp_path_factory):
    """A data directory with one organization, and the fixture vault as a git repository beside it."""
    root = tmp_path_factory.mktemp("kb-cli")
    vault = GitVault(root / "vault")
    vault.write(vault_files())
    vault.commit("the fixture vault")
    memex(root / "data", "org", "create", "--name", "Shelf Co", "--slug", ORG)
    yield root / "data", vault
    vault.close()


def test_create_then_sync_then_an_incremental_sync(shelf):
    data, vault = shelf
    made = as_json(memex(data, "kb", "create", "--org", ORG, "--slug", "handbook", "--git", str(vault.path),
                         "--visibility", "open", "--name", "Handbook"))
    assert made["webhook_secret"] and made["webhook_path"] == f"/hooks/github/{made['id']}"
    assert made["source"] == {"type": "git", "url": os.path.realpath(vault.path), "branch": "main",
                              "include": ["**/*.md"], "exclude": ["drafts/**", ".*/**", "**/.*/**"]}
    assert made["sync"]["state"] == "queued" and made["visibility"] == "open"

    done = memex(data, "kb", "sync", "--org", ORG, "handbook")
    assert "sync handbook: " in done.stderr and "files/s" in done.stderr  # tqdm's bars
    assert "100%|" in done.stderr and f"| {len(READ)}/{len(READ)} [" in done.stderr and "embed handbook: " in done.stderr
    result = as_json(done)
    assert result["id"] == made["sync"]["id"]  # the queued first sync is the one run
    assert result["state"] == "succeeded" and result["mode"] == "full" and result["files_total"] == len(READ)
    assert result["counts"] == {"added": ADDED, "updated": 0, "deleted": 0, "unchanged": 0, "skipped": len(SKIPPED),
                                "failed": len(FAILED)}
    assert ADDED == len(TYPES_BY_ID) + 4  # the alias, the two invalid fields (kept with warnings), the first id holder
    assert sorted(e["path"] for e in result["errors"]) == sorted(FAILED)
    assert sorted(s["path"] for s in result["skipped"]) == SKIPPED
    assert {(u["path"], u["target"]) for u in result["unresolved_links"]} == set(UNRESOLVED_LINKS)
    kb = result["knowledge_base"]
    assert kb["entries"] == ADDED and kb["chunks"] >= ADDED and kb["chunks_searchable"] == kb["chunks"]

    first = vault_files()
    changed = next(p for p in sorted(first) if p.startswith("data/people/") and p not in PROBLEM_FILES)
    gone = next(p for p in sorted(first) if p.startswith("data/places/") and p not in PROBLEM_FILES)
    vault.write({changed: first[changed] + b"\nA later paragraph about the orchard ladders.\n", gone: None,
                 "data/concepts/ladder-rota.md": b"---\ntitle: Ladder Rota\ndate: 2024-05-01\npublish: true\n---\n\n"
                                                 b"Who checks the orchard ladders each week.\n"})
    head = vault.commit("edit one, remove one, add one")
    again = as_json(memex(data, "kb", "sync", "--org", ORG, "handbook"))
    assert again["state"] == "succeeded" and again["mode"] == "incremental" and again["commit"] == head
    # the three files of the commit, and the file refused for a duplicate id (tried by every sync: the id may be free)
    assert again["files_total"] == 4
    assert again["counts"] == {"added": 1, "updated": 1, "deleted": 1, "unchanged": len(READ) - 3, "skipped": 0,
                               "failed": 1}
    assert again["knowledge_base"]["entries"] == ADDED
    assert again["knowledge_base"]["chunks_searchable"] == again["knowledge_base"]["chunks"]

    status = as_json(memex(data, "kb", "status", "--org", ORG, "handbook"))
    assert status["last_commit"] == head and status["last_sync"]["id"] == again["id"]
    older = as_json(memex(data, "kb", "status", "--org", ORG, "handbook", "--sync", result["id"]))
    assert sorted(e["path"] for e in older["last_sync"]["errors"]) == sorted(FAILED)
    assert {w["field"] for w in older["last_sync"]["warnings"]} == {"date", "url"}


def _zip(files: dict[str, bytes], top: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        for path, content in sorted(files.items()):
            z.writestr(f"{top}/{path}", content)
    return buffer.getvalue()


def test_import_a_folder_then_a_zip(shelf, tmp_path):
    data, _ = shelf
    folder = tmp_path / "export"
    for path, content in vault_files().items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(content)
    made = as_json(memex(data, "kb", "create", "--org", ORG, "--slug", "uploaded", "--upload"))
    assert made["source"]["type"] == "upload" and made["sync"] is None

    done = memex(data, "kb", "import", "--org", ORG, "uploaded", str(folder))
    assert "packed " in done.stderr and "sync uploaded: " in done.stderr
    result = as_json(done)
    assert result["state"] == "succeeded" and result["trigger"] == "import" and result["files_total"] == len(READ)
    assert result["counts"] == {"added": ADDED, "updated": 0, "deleted": 0, "unchanged": 0, "skipped": len(SKIPPED),
                                "failed": len(FAILED)}
    assert sorted(e["path"] for e in result["errors"]) == sorted(FAILED)

    files = vault_files()
    edited = next(p for p in sorted(files) if p.startswith("data/projects/") and p not in PROBLEM_FILES)
    dropped = next(p for p in sorted(files) if p.startswith("data/groups/") and p not in PROBLEM_FILES)
    files[edited] += b"\nThe canopy's second phase starts in spring.\n"
    del files[dropped]
    archive = tmp_path / "vault-main.zip"
    archive.write_bytes(_zip(files, "vault-main"))  # GitHub's layout: one top folder, stripped
    again = as_json(memex(data, "kb", "import", "--org", ORG, "uploaded", str(archive)))
    assert again["state"] == "succeeded"
    assert again["counts"]["updated"] == 1 and again["counts"]["deleted"] == 1 and again["counts"]["added"] == 0
    assert again["knowledge_base"]["entries"] == ADDED - 1

    listed = {kb["slug"]: kb for kb in as_json(memex(data, "kb", "list", "--org", ORG))}
    assert listed["uploaded"]["source"]["type"] == "upload" and listed["uploaded"]["entries"] == ADDED - 1
    assert listed["uploaded"]["last_sync"]["id"] == again["id"]


def _refused(out: subprocess.CompletedProcess, says: str) -> None:
    lines = out.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and says in lines[-1], out.stderr
    assert "Traceback" not in out.stderr


def test_errors_are_one_line_and_exit_2(shelf, tmp_path):
    data, vault = shelf
    _refused(memex(data, "kb", "list", "--org", "no-such-org", code=2), "organization not found")
    _refused(memex(data, "kb", "status", "--org", ORG, "nothing-here", code=2), "knowledge base not found")
    _refused(memex(data, "kb", "sync", "--org", ORG, "nothing-here", code=2), "knowledge base not found")
    _refused(memex(data, "kb", "create", "--org", ORG, "--slug", "bad", "--git", "ssh://example.org/r.git", code=2),
             "scheme is not supported")
    _refused(memex(data, "kb", "create", "--org", ORG, "--slug", "bad", "--git", str(tmp_path / "missing"), code=2),
             "no such folder")
    _refused(memex(data, "kb", "create", "--org", ORG, "--slug", "bad", "--git", "https://example.org/r.git",
                   "--token-env", "KB_CLI_TEST_TOKEN", code=2), "KB_CLI_TEST_TOKEN")
    _refused(memex(data, "kb", "create", "--org", ORG, "--slug", "Bad Slug", "--upload", code=2), "slug")
    memex(data, "kb", "create", "--org", ORG, "--slug", "git-only", "--git", str(vault.path), "--no-sync")
    memex(data, "kb", "create", "--org", ORG, "--slug", "upload-only", "--upload")
    _refused(memex(data, "kb", "import", "--org", ORG, "git-only", str(tmp_path), code=2), "syncs from git")
    _refused(memex(data, "kb", "sync", "--org", ORG, "upload-only", code=2), "filled by uploads")
    _refused(memex(data, "kb", "import", "--org", ORG, "upload-only", str(tmp_path / "nothing.zip"), code=2),
             "no such folder or archive")
    (tmp_path / "not-an-archive.zip").write_bytes(b"hello")
    _refused(memex(data, "kb", "import", "--org", ORG, "upload-only", str(tmp_path / "not-an-archive.zip"), code=2),
             "not a .zip")


def test_a_sync_that_fails_exits_1(shelf):
    data, vault = shelf
    memex(data, "kb", "create", "--org", ORG, "--slug", "wrong-branch", "--git", str(vault.path), "--branch", "nope",
          "--no-sync")
    failed = memex(data, "kb", "sync", "--org", ORG, "wrong-branch", code=1)  # retried twice (1 s, 2 s), then failed
    result = as_json(failed)
    assert result["state"] == "failed" and "nope" in result["error"]
    assert result["knowledge_base"]["entries"] == 0
    queued = as_json(memex(data, "kb", "sync", "--org", ORG, "wrong-branch", "--no-wait"))
    assert queued["state"] == "queued" and queued["id"] != result["id"]


async def test_a_source_the_operator_allowed_keeps_working_when_a_tenant_edits_the_knowledge_base(tmp_path):
    """`memex kb create --git PATH` (the operator) may name any local path; a tenant's later PATCH of other fields
    (over REST, under the deployment's stricter policy) keeps that source, while naming a new local path is refused."""
    import pytest

    from services.adapters.hash_embedder import HashEmbedder
    from services.errors import InvalidInput
    from services.knowledge.bases import KnowledgeBases, SourcePolicy
    from services.storage.scoped import OrgSql
    from tests.stores import make_stores

    control, stores = await make_stores(tmp_path, HashEmbedder(), orgs=("org_a",))
    sql = (await stores.open("org_a")).sql
    vault = tmp_path / "vault"
    vault.mkdir()
    operator = KnowledgeBases(sql, OrgSql(control, "org_a"), policy=SourcePolicy(local_roots=(str(vault),)))
    tenant = KnowledgeBases(sql, OrgSql(control, "org_a"))  # MEMEX_KB_LOCAL_ROOTS unset
    await operator.create(slug="notes", name=None, visibility="private", document_tier="members",
                          source={"type": "git", "url": str(vault)}, ontology=None, sync=False)
    row = await tenant.update("notes", {"name": "Notes", "source": {"branch": "trunk"}})
    assert row["name"] == "Notes" and '"branch": "trunk"' in row["source"] and str(vault.resolve()) in row["source"]
    with pytest.raises(InvalidInput):
        await tenant.update("notes", {"source": {"url": str(tmp_path)}})
    await stores.close()
    await control.close()
