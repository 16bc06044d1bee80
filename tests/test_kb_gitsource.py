"""Knowledge bases' git sources: which URLs a tenant may give, and the bare mirror read through dulwich (a local
repository path and git smart HTTP on loopback, with and without a token). No git binary: PATH is emptied."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.errors import InvalidInput
from services.knowledge.gitsource import Change, GitSource, SourceError, check_source_url
from tests.kb_vault import GitVault, serve_git_http, vault_files

TOKEN = "ghp_Sup3rSecretT0ken_42"


@pytest.fixture(autouse=True)
def _no_git_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing here may need a git executable."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert shutil.which("git") is None


# -- check_source_url ---------------------------------------------------------------------------------------


def test_https_urls_are_normalised() -> None:
    check = check_source_url
    assert check("https://GitHub.com/Org/Vault.git", local_roots=(), allow_http=False) == "https://github.com/Org/Vault.git"
    assert check("  https://git.example.org:8443/team/kb/  ", local_roots=(), allow_http=False) == \
        "https://git.example.org:8443/team/kb"
    assert check("HTTPS://[2606:4700::1111]:3000/x", local_roots=(), allow_http=False) == "https://[2606:4700::1111]:3000/x"
    assert check("http://127.0.0.1:9000/vault.git", local_roots=(), allow_http=True) == "http://127.0.0.1:9000/vault.git"


@pytest.mark.parametrize("url", ["https://localhost/x", "https://127.0.0.1/x", "https://10.1.2.3/x", "https://[::1]:3000/x",
                                 "https://169.254.169.254/latest/meta-data", "https://192.168.0.10/vault.git",
                                 "https://api.localhost/v"])
def test_a_tenant_cannot_point_a_source_at_private_addresses(url: str) -> None:
    """A hosted service must not fetch its own network or a cloud metadata endpoint for a tenant (only a development
    deployment, MEMEX_KB_ALLOW_HTTP, may)."""
    with pytest.raises(InvalidInput) as exc:
        check_source_url(url, local_roots=(), allow_http=False)
    assert exc.value.details["field"] == "source.url"
    assert check_source_url(url, local_roots=(), allow_http=True).startswith("https://")


def test_local_paths_inside_the_roots(tmp_path: Path) -> None:
    root = tmp_path / "vaults"
    (root / "team" / "kb").mkdir(parents=True)
    alias = tmp_path / "alias"
    alias.symlink_to(root, target_is_directory=True)
    real = os.path.realpath(root / "team" / "kb")
    assert check_source_url(str(root / "team" / "kb"), local_roots=(str(root),), allow_http=False) == real
    assert check_source_url(f"file://{root}/team/kb", local_roots=(str(root),), allow_http=False) == real
    assert check_source_url(str(alias / "team" / "kb"), local_roots=(str(root),), allow_http=False) == real
    assert check_source_url(str(root / "team" / "kb"), local_roots=(str(alias),), allow_http=False) == real


@pytest.mark.parametrize(("url", "words"), [
    ("https://user:pw@github.com/org/vault.git", "source.token"),
    ("https://ghp_token@github.com/org/vault.git", "source.token"),
    ("http://github.com/org/vault.git", "https"),
    ("ssh://git@github.com/org/vault.git", "https"),
    ("git://github.com/org/vault.git", "https"),
    ("git@github.com:org/vault.git", "https"),
    ("ftp://example.org/vault", "https"),
    ("vaults/team", "https"),
    ("https://github.com/org/vault.git?ref=main", "query"),
    ("https://github.com:99999/org/vault.git", "port"),
    ("https://bad_host!/x", "host"),
    ("https:///nohost", "host"),
    ("https://github.com/org/va ult", "spaces"),
    ("", "characters"),
    ("https://example.org/" + "a" * 2000, "2000"),
])
def test_refused_urls(url: str, words: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        check_source_url(url, local_roots=("/",), allow_http=False)
    assert caught.value.details == {"field": "source.url"}
    assert words in caught.value.message
    assert "pw@" not in caught.value.message and "ghp_token" not in caught.value.message


def test_local_paths_outside_the_roots_are_refused(tmp_path: Path) -> None:
    root, outside = tmp_path / "vaults", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (root / "escape").symlink_to(outside, target_is_directory=True)
    for url in (str(outside), f"file://{outside}", str(root / ".." / "elsewhere"), str(root / "escape"),
                str(tmp_path / "vaults-sibling")):
        with pytest.raises(InvalidInput) as caught:
            check_source_url(url, local_roots=(str(root),), allow_http=True)
        assert "MEMEX_KB_LOCAL_ROOTS" in caught.value.message and caught.value.details == {"field": "source.url"}
    with pytest.raises(InvalidInput) as caught:  # no roots: never
        check_source_url(str(root), local_roots=(), allow_http=True)
    assert "MEMEX_KB_LOCAL_ROOTS" in caught.value.message
    with pytest.raises(InvalidInput):
        check_source_url("file://otherhost/srv/vault", local_roots=("/",), allow_http=True)


# -- the mirror -------------------------------------------------------------------------------------------------


@pytest.fixture
def vault(tmp_path: Path) -> Iterator[GitVault]:
    v = GitVault(tmp_path / "vault")
    v.write(vault_files())
    v.symlink("docs/commons-lab/quorum-shortcut.md", "../../data/concepts/quorum.md")
    v.commit("the fixture vault")
    yield v
    v.close()


@pytest.fixture(params=["local", "http", "http+token"])
def remote(request: pytest.FixtureRequest, vault: GitVault) -> Iterator[tuple[str, str | None]]:
    """(url, token) of the vault, by local path or over smart HTTP."""
    if request.param == "local":
        yield str(vault.path), None
        return
    token = TOKEN if request.param == "http+token" else None
    with serve_git_http(vault.path, token=token) as url:
        yield url, token


@pytest.fixture
def source(tmp_path: Path, remote: tuple[str, str | None]) -> Iterator[GitSource]:
    url, token = remote
    with GitSource(tmp_path / "cache" / "kb1", url, token=token, timeout=20) as s:
        yield s


def test_fetch_then_files(source: GitSource, vault: GitVault) -> None:
    head = source.fetch()
    assert head == vault.head()
    files = source.files(head)
    expected = vault_files()
    assert set(files) == set(expected)  # the symlink is left out
    for path, (blob, size) in files.items():
        assert size == len(expected[path])
        assert source.read(blob) == expected[path]
    assert source.symlinks(head) == ["docs/commons-lab/quorum-shortcut.md"]
    assert source.has_commit(head) and not source.has_commit("0" * 40) and not source.has_commit("nope")
    assert source.fetch() == head  # nothing new: same head


def test_diff_shows_adds_modifications_deletions_and_renames(source: GitSource, vault: GitVault) -> None:
    old = source.fetch()
    vault.write({"data/concepts/quorum.md": "# Quorum\n\nrewritten\n", "docs/commons-lab/new-note.md": "new",
                 "data/links/mutual-aid-ledger.md": None})
    vault.rename("data/places/larchwood-valley.md", "data/places/valley.md")
    vault.symlink("docs/another-link.md", "../data/people/ada-okonkwo.md")
    vault.commit("many changes")
    new = source.fetch()
    assert new == vault.head() != old
    assert source.is_ancestor(old, new) and not source.is_ancestor(new, old)
    files = source.files(new)
    changes = sorted(source.diff(old, new), key=lambda c: c.path)
    assert changes == [
        Change("modify", "data/concepts/quorum.md", files["data/concepts/quorum.md"][0]),
        Change("delete", "data/links/mutual-aid-ledger.md", None),
        Change("delete", "data/places/larchwood-valley.md", None),
        Change("add", "data/places/valley.md", files["data/places/valley.md"][0]),
        Change("add", "docs/commons-lab/new-note.md", files["docs/commons-lab/new-note.md"][0]),
    ]
    assert source.read(files["data/places/valley.md"][0]) == vault_files()["data/places/larchwood-valley.md"]
    assert source.diff(new, new) == []
    assert sorted(source.symlinks(new)) == ["docs/another-link.md", "docs/commons-lab/quorum-shortcut.md"]


def test_a_file_becoming_a_symlink_is_a_deletion(source: GitSource, vault: GitVault) -> None:
    old = source.fetch()
    vault.write({"data/concepts/quorum.md": None})
    vault.symlink("data/concepts/quorum.md", "../people/ada-okonkwo.md")
    new = vault.commit("quorum is now a link")
    assert source.fetch() == new
    assert source.diff(old, new) == [Change("delete", "data/concepts/quorum.md", None)]
    assert source.diff(new, old) == [Change("add", "data/concepts/quorum.md", source.files(old)["data/concepts/quorum.md"][0])]


def test_submodules_are_left_out(source: GitSource, vault: GitVault) -> None:
    old = source.fetch()
    vault.submodule("vendor/theme", "1234567890abcdef1234567890abcdef12345678")
    new = vault.commit("a submodule")
    assert source.fetch() == new
    assert "vendor/theme" not in source.files(new) and source.symlinks(new) == source.symlinks(old)
    assert source.diff(old, new) == []


def test_force_push(source: GitSource, vault: GitVault) -> None:
    first = source.fetch()
    vault.write({"docs/commons-lab/pushed.md": "pushed then rewritten"})
    second = vault.commit("to be dropped")
    assert source.fetch() == second
    vault.reset_hard(first)
    vault.write({"docs/commons-lab/forced.md": "after the force-push"})
    third = vault.commit("force-pushed")
    assert source.fetch() == third
    assert not source.is_ancestor(second, third)
    assert source.is_ancestor(first, third)
    assert source.has_commit(second)  # the dropped commit stays readable in the mirror
    assert sorted((c.kind, c.path) for c in source.diff(second, third)) == [
        ("add", "docs/commons-lab/forced.md"), ("delete", "docs/commons-lab/pushed.md")]


def test_commits_on_other_branches_are_ignored(source: GitSource, vault: GitVault) -> None:
    head = source.fetch()
    vault.commit_on_branch("feature/drafts", {"docs/commons-lab/elsewhere.md": "not on main"}, "elsewhere")
    assert source.fetch() == head
    assert "docs/commons-lab/elsewhere.md" not in source.files(head)


def test_another_branch(tmp_path: Path, vault: GitVault) -> None:
    sha = vault.commit_on_branch("publish", {"docs/commons-lab/only-here.md": "x"}, "the publish branch")
    with GitSource(tmp_path / "cache", str(vault.path), branch="publish") as s:
        assert s.fetch() == sha
        assert "docs/commons-lab/only-here.md" in s.files(sha)


def test_missing_branch_lists_the_branches(tmp_path: Path, remote: tuple[str, str | None], vault: GitVault) -> None:
    vault.commit_on_branch("release", {"x.md": "x"}, "release")
    url, token = remote
    with GitSource(tmp_path / "cache", url, branch="trunk", token=token) as s, pytest.raises(SourceError) as caught:
        s.fetch()
    message = str(caught.value)
    assert "trunk" in message and "main" in message and "release" in message
    for i in range(12):
        vault.commit_on_branch(f"topic-{i:02d}", {"x.md": str(i)}, "topic")
    with GitSource(tmp_path / "cache", url, branch="trunk", token=token) as s, pytest.raises(SourceError) as caught:
        s.fetch()
    assert "(and 4 more)" in str(caught.value)


def test_an_empty_repository(tmp_path: Path) -> None:
    empty = GitVault(tmp_path / "empty")
    with GitSource(tmp_path / "cache", str(empty.path)) as s, pytest.raises(SourceError) as caught:
        s.fetch()
    assert "no branches" in str(caught.value)
    empty.close()


def test_token_right_wrong_and_missing(tmp_path: Path, vault: GitVault) -> None:
    with serve_git_http(vault.path, token=TOKEN) as url:
        with GitSource(tmp_path / "good", url, token=TOKEN) as s:
            assert s.fetch() == vault.head()
            assert TOKEN not in repr(s)
        for cache, token in (("wrong", "ghp_WrongToken_7"), ("none", None)):
            with GitSource(tmp_path / cache, url, token=token) as s, pytest.raises(SourceError) as caught:
                s.fetch()
            assert "authentication" in str(caught.value) or "credentials" in str(caught.value)
            assert TOKEN not in str(caught.value) and (token is None or token not in str(caught.value))
        for cache in ("good", "wrong", "none"):  # the token is written nowhere
            for root, _dirs, names in os.walk(tmp_path / cache):
                for name in names:
                    assert TOKEN.encode() not in (Path(root) / name).read_bytes(), (root, name)
        # the token is scrubbed even where the server or the URL would echo it
        with GitSource(tmp_path / "echo", f"{url}/{TOKEN}.git", token=TOKEN) as s, pytest.raises(SourceError) as caught:
            s.fetch()
        assert TOKEN not in str(caught.value) and "***" in str(caught.value)


def test_unreachable_and_not_a_repository(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with GitSource(tmp_path / "a", f"http://127.0.0.1:{port}/vault.git", token=TOKEN, timeout=5) as s:
        with pytest.raises(SourceError) as caught:
            s.fetch()
        assert str(port) in str(caught.value) and TOKEN not in str(caught.value)
    (tmp_path / "plain-folder").mkdir()
    with GitSource(tmp_path / "b", str(tmp_path / "plain-folder")) as s, pytest.raises(SourceError) as caught:
        s.fetch()
    assert "no git repository" in str(caught.value)
    with GitSource(tmp_path / "c", str(tmp_path / "plain-folder")) as s, pytest.raises(SourceError):
        s.files("0" * 40)  # nothing fetched yet
    with pytest.raises(SourceError):
        GitSource(tmp_path / "d", "ssh://git@example.org/x.git")


def test_the_mirror_is_recloned_when_deleted_or_damaged(tmp_path: Path, remote: tuple[str, str | None],
                                                        vault: GitVault) -> None:
    url, token = remote
    cache = tmp_path / "cache"
    with GitSource(cache, url, token=token) as s:
        head = s.fetch()
    shutil.rmtree(cache)  # deleted (cache_dir and all)
    with GitSource(cache, url, token=token) as s:
        assert s.fetch() == head and len(s.files(head)) == len(vault_files())
    for pack in (cache / "mirror.git" / "objects" / "pack").iterdir():  # damaged: its objects are gone
        pack.unlink()
    vault.write({"docs/commons-lab/later.md": "later"})
    later = vault.commit("later")
    with GitSource(cache, url, token=token) as s:
        assert s.fetch() == later
        assert s.read(s.files(later)["data/concepts/quorum.md"][0]) == vault_files()["data/concepts/quorum.md"]
    for pack in (cache / "mirror.git" / "objects" / "pack").iterdir():  # damaged: unreadable packs
        pack.write_bytes(b"\0garbage" * 10)
    vault.write({"docs/commons-lab/even-later.md": "even later"})
    later = vault.commit("even later")
    with GitSource(cache, url, token=token) as s:
        assert s.fetch() == later
        assert "docs/commons-lab/even-later.md" in s.files(later)
    (cache / "mirror.git" / "HEAD").write_bytes(b"garbage")  # no longer a repository
    (cache / "mirror.git" / "objects").rename(cache / "mirror.git" / "objects-moved")
    with GitSource(cache, url, token=token) as s:
        assert s.fetch() == later and s.has_commit(head)


def test_a_changed_url_gets_a_new_mirror(tmp_path: Path, vault: GitVault) -> None:
    other = GitVault(tmp_path / "other")
    other.write({"README.md": "another repository"})
    other_head = other.commit("unrelated")
    cache = tmp_path / "cache"
    with GitSource(cache, str(vault.path)) as s:
        head = s.fetch()
    with GitSource(cache, str(other.path)) as s:
        assert s.fetch() == other_head
        assert not s.has_commit(head)  # the first mirror was dropped, not reused
        assert list(s.files(other_head)) == ["README.md"]
    assert (cache / "mirror.url").read_text().strip() == str(other.path)
    other.close()


def test_a_bare_local_repository(tmp_path: Path, vault: GitVault) -> None:
    with GitSource(tmp_path / "first", str(vault.path)) as s:
        head = s.fetch()
    bare = tmp_path / "first" / "mirror.git"  # a bare repository
    with GitSource(tmp_path / "second", f"file://{bare}") as s:
        assert s.fetch() == head
        assert set(s.files(head)) == set(vault_files())
