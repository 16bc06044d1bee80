"""The knowledge-base test helpers keep their promises: the fixture vault's entries, releases, links and problem
files, the generated vaults' determinism and mix, and GitVault's history operations."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.kb_vault import (
    ALIASED_TYPES, ATTACHMENT, BROKEN_YAML_FILE, CONTENT_TYPES, DUPLICATE_ID, EMBEDS, GROUP_OF, GROUPS, HUGE_FILE,
    INVALID_FIELDS, KEYWORDS, LATIN1_FILE, LINKS, MAX_ENTRY_BYTES, PATHS_BY_ID, PROBLEM_FILES, RELEASE_OF, RELEASES,
    STATUS_OF, TYPES_BY_ID, UNRESOLVED_LINKS, UNRESOLVED_TARGETS, GitVault, generated_vault, vault_files,
)

FOLDER_TYPES = {"data/concepts": "tag", "data/links": "link", "data/resources/patterns": "pattern",
                "data/resources/practices": "practice", "data/resources/primitives": "primitive",
                "data/resources/protocols": "protocol", "data/resources/playbooks": "playbook",
                "data/stories/studies": "study", "data/stories/articles": "article", "data/questions": "question",
                "data/people": "person", "data/groups": "group", "data/projects": "project", "data/places": "place",
                "data/gatherings": "gathering"}
FRONTMATTER = re.compile(r"\A---\n(.*?)\n---\n", re.S)


def split(data: bytes) -> tuple[dict, str]:
    text = data.decode("utf-8")
    match = FRONTMATTER.match(text)
    assert match, text[:80]
    return yaml.safe_load(match.group(1)), text[match.end():]


def entry_id(path: str) -> str:
    folder, _, name = path.rpartition("/")
    return folder.rpartition("/")[2] if name == "index.md" else name.removesuffix(".md")


def test_every_content_type_is_published() -> None:
    files = vault_files()
    assert sorted(set(TYPES_BY_ID.values())) == sorted(CONTENT_TYPES) and len(CONTENT_TYPES) == 18
    for eid, path in PATHS_BY_ID.items():
        assert entry_id(path) == eid
        meta, body = split(files[path])
        assert meta["publish"] is True and "draft" not in meta
        assert meta["title"] and meta["description"] and meta["tags"] and meta["date"]
        folder = path.rpartition("/")[0]
        if path.startswith("data/"):
            assert "type" not in meta and FOLDER_TYPES[folder] == TYPES_BY_ID[eid]
        else:
            assert meta["type"] == TYPES_BY_ID[eid] and path.split("/")[1] in GROUPS
        assert meta.get("group") == GROUP_OF.get(eid)
        assert meta.get("status") == STATUS_OF.get(eid)
    assert len(set(GROUP_OF.values())) == 3 and STATUS_OF["solar-canopy"] == "active"
    assert STATUS_OF["how-to-weight-votes"] == "open"
    quorum, _ = split(files[PATHS_BY_ID["quorum"]])
    assert quorum["aliases"] and quorum["relatedTerms"]
    link, _ = split(files[PATHS_BY_ID["mutual-aid-ledger"]])
    assert link["url"].startswith("https://")
    pattern, _ = split(files[PATHS_BY_ID["rotating-facilitation"]])
    assert pattern["problem"] and pattern["solution"]
    project, _ = split(files[PATHS_BY_ID["solar-canopy"]])
    assert str(project["startDate"]) == "2024-04-01"


def test_keywords_name_one_file_each() -> None:
    files = {path: data.decode("utf-8", "replace").lower() for path, data in vault_files().items()}
    for eid, word in KEYWORDS.items():
        pattern = re.compile(rf"(?<![a-z0-9]){word}(?![a-z0-9])")
        assert [p for p, text in files.items() if pattern.search(text)] == [PATHS_BY_ID[eid]], word


def test_releases_nest() -> None:
    files = vault_files()
    for folder, release in RELEASES.items():
        assert f"{folder}/index.base" in files and f"{folder}/index.md" in files
        assert entry_id(f"{folder}/index.md") == release["id"]
        meta, _ = split(files[f"{folder}/index.md"])
        assert meta["title"] == release["title"] and meta["publish"] is True and meta["description"]
        parent = folder.rpartition("/")[0]
        assert release["parent"] == (RELEASES[parent]["id"] if parent in RELEASES else None)
    assert any(r["parent"] for r in RELEASES.values())
    for eid, release in RELEASE_OF.items():
        folder = next(f for f, r in RELEASES.items() if r["id"] == release)
        assert PATHS_BY_ID[eid].startswith(folder + "/")
    per_release = {r: sum(1 for v in RELEASE_OF.values() if v == r) for r in RELEASE_OF.values()}
    assert all(n >= 3 for n in per_release.values())  # the index and a couple of entries


def test_links() -> None:
    files = vault_files()
    forms = set()
    for source, targets in LINKS.items():
        body = split(files[PATHS_BY_ID[source]])[1]
        for target in targets:
            wiki = re.search(rf"\[\[{re.escape(target)}([|#][^\]]*)?\]\]", body)
            relative = re.search(rf"\]\([^)]*{re.escape(PATHS_BY_ID[target].rpartition('/')[2])}\)", body)
            assert wiki or relative, (source, target)
            forms.add("relative" if relative and not wiki else (wiki.group(1) or " ")[0])
    assert forms == {" ", "|", "#", "relative"}
    for source, attachments in EMBEDS.items():
        for name in attachments:
            assert f"![[{name}]]" in split(files[PATHS_BY_ID[source]])[1]
            assert any(p.endswith("/" + name) for p in files)
    assert {t for _, t in UNRESOLVED_LINKS} == UNRESOLVED_TARGETS and not UNRESOLVED_TARGETS & set(PATHS_BY_ID)
    for path, target in UNRESOLVED_LINKS:
        assert f"[[{target}]]" in files[path].decode()


def test_problem_files() -> None:
    files = vault_files()
    assert set(PROBLEM_FILES) <= set(files)
    assert not {entry_id(p) for p in PROBLEM_FILES} & set(TYPES_BY_ID)
    raw = files[BROKEN_YAML_FILE].decode()
    try:
        yaml.safe_load(FRONTMATTER.match(raw).group(1))
        raise AssertionError("the broken YAML parsed")
    except yaml.YAMLError:
        pass
    try:
        files[LATIN1_FILE].decode("utf-8")
        raise AssertionError("the Latin-1 file decoded as UTF-8")
    except UnicodeDecodeError:
        assert "Zoé" in files[LATIN1_FILE].decode("latin-1")
    assert len(files[HUGE_FILE]) > MAX_ENTRY_BYTES and split(files[HUGE_FILE])[0]["publish"] is True
    assert files[ATTACHMENT].startswith(b"\x89PNG\r\n\x1a\n")
    meta = {p: split(files[p])[0] for p, why in PROBLEM_FILES.items() if p.endswith(".md") and why not in
            ("malformed_yaml", "not_utf8")}
    by_problem = {why: [p for p in meta if PROBLEM_FILES[p] == why] for why in set(PROBLEM_FILES.values())}
    assert meta[by_problem["unpublished"][0]]["publish"] is False
    assert "publish" not in meta[by_problem["no_publish"][0]]
    assert meta[by_problem["draft"][0]]["draft"] is True and meta[by_problem["draft"][0]]["publish"] is True
    assert {entry_id(p) for p in by_problem["duplicate_id"]} == {DUPLICATE_ID} and len(by_problem["duplicate_id"]) == 2
    assert by_problem["drafts_folder"][0].startswith("drafts/") and all(
        p.startswith(".obsidian/") and p.endswith(".json") for p in PROBLEM_FILES if PROBLEM_FILES[p] == "dot_folder")
    for path, (written, canonical) in ALIASED_TYPES.items():
        assert path.startswith("docs/") and meta[path]["type"] == written and canonical == "tag"
    for path, field in INVALID_FIELDS.items():
        assert str(meta[path][field]) in ("not-a-date", "not a url")


def test_generated_vaults_are_deterministic_and_mixed() -> None:
    first, again, other = generated_vault(300, seed=3), generated_vault(300, seed=3), generated_vault(300, seed=4)
    assert first == again and first != other and len(first) == 300
    broken = unpublished = unknown = undated = links = 0
    for path, data in first.items():
        assert path.endswith(".md") and (path.startswith("data/") or path.startswith("docs/"))
        text = data.decode("utf-8")
        links += text.count("[[")
        try:
            meta, body = split(data)
        except yaml.YAMLError:
            broken += 1
            continue
        unpublished += meta["publish"] is False
        unknown += meta.get("type") not in (None, *CONTENT_TYPES)
        undated += "date" not in meta
        assert 100 <= len(body.split()) <= 1200
    assert 1 <= broken <= 30 and 3 <= unpublished <= 40 and 3 <= unknown <= 40 and 1 <= undated <= 40
    assert links > 300
    short = generated_vault(5, seed=1, words=(10, 20))
    assert all(len(split(d)[1].split()) < 120 for d in short.values() if b"unclosed" not in d)


def test_git_vault_history(tmp_path: Path) -> None:
    vault = GitVault(tmp_path / "v")
    vault.write({"a.md": "one", "docs/b.md": b"two"})
    first = vault.commit("first")
    assert vault.head() == first and (tmp_path / "v" / "a.md").read_text() == "one"
    vault.rename("a.md", "docs/a.md")
    vault.symlink("link.md", "docs/a.md")
    vault.write({"docs/b.md": None})
    second = vault.commit("second")
    assert not (tmp_path / "v" / "a.md").exists() and (tmp_path / "v" / "link.md").is_symlink()
    vault.reset_hard(first)
    assert vault.head() == first and (tmp_path / "v" / "a.md").read_text() == "one"
    assert not (tmp_path / "v" / "link.md").exists() and (tmp_path / "v" / "docs" / "b.md").read_bytes() == b"two"
    assert vault.commit("same tree, new commit") not in (first, second)
    other = vault.commit_on_branch("other", {"c.md": "three"}, "elsewhere")
    assert vault.repo.refs[b"refs/heads/other"].decode() == other and not (tmp_path / "v" / "c.md").exists()
    replay = GitVault(tmp_path / "w")
    replay.write({"a.md": "one", "docs/b.md": b"two"})
    assert replay.commit("first") == first  # deterministic author, committer and times
    vault.close()
    replay.close()
