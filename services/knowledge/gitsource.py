"""A knowledge base's git source, read through dulwich (no git binary needed).

``check_source_url`` vets what a tenant may name as a source: an ``https://`` URL (``http://`` only when the
deployment allows it), or a local path inside one of the deployment's ``MEMEX_KB_LOCAL_ROOTS``.

``GitSource`` keeps a bare mirror of one branch under a cache folder: ``fetch`` brings it up to date (a
force-push overwrites the branch), then the sync reads trees, diffs and blobs from the mirror. A token is sent
as HTTP basic auth (user ``x-access-token``), held in memory only, and scrubbed from every error message.
"""

from __future__ import annotations

import base64
import contextlib
import os
import ipaddress
import re
import shutil
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from dulwich.client import GitClient, HTTPProxyUnauthorized, HTTPUnauthorized, LocalGitClient, Urllib3HttpGitClient
from dulwich.diff_tree import TreeChange, tree_changes
from dulwich.errors import GitProtocolError, NotGitRepository
from dulwich.object_store import iter_tree_contents
from dulwich.objects import Blob, Commit, ObjectID
from dulwich.refs import Ref
from dulwich.repo import Repo

from services.errors import InvalidInput

try:  # POSIX: serialise fetches of one mirror across threads and processes
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["SourceError", "Change", "GitSource", "check_source_url", "MAX_URL_LENGTH", "TOKEN_USERNAME",
           "LOCAL_ROOTS_SETTING"]

MAX_URL_LENGTH = 2000
#: The basic-auth user name sent with a token (GitHub's convention; Gitea and GitLab accept any name with a PAT).
TOKEN_USERNAME = "x-access-token"
LOCAL_ROOTS_SETTING = "MEMEX_KB_LOCAL_ROOTS"
#: Branches named in the "branch not found" message.
BRANCHES_SHOWN = 10
HEADS = Ref(b"refs/heads/")
MIRROR_DIR = "mirror.git"
URL_FILE = "mirror.url"
LOCK_FILE = "mirror.lock"

_HOST = re.compile(r"^(?:[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*\.?$")
_SHA = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")
#: Failures of the remote side (or the network): reported as they are, never blamed on the mirror.
_REMOTE_ERRORS = (GitProtocolError, HTTPUnauthorized, HTTPProxyUnauthorized, NotGitRepository, TimeoutError,
                  ConnectionError)


class SourceError(Exception):
    """The source could not be read (unreachable, auth refused, branch missing...). ``str(exc)`` is safe to show
    and to log: it never contains the token."""


class _Damaged(Exception):
    """The mirror lacks objects it should hold: start again from an empty one."""


# -- what a tenant may name as a source ------------------------------------------------------------------


def _refuse(message: str) -> InvalidInput:
    return InvalidInput(message, details={"field": "source.url"})


def check_source_url(url: str, *, local_roots: tuple[str, ...], allow_http: bool) -> str:
    """The normalised source URL (or absolute real path), or InvalidInput naming ``source.url``."""
    if not isinstance(url, str) or not url.strip() or len(url) > MAX_URL_LENGTH:
        raise _refuse(f"source.url must be a URL of 1-{MAX_URL_LENGTH} characters")
    url = url.strip()
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise _refuse("source.url must not contain spaces or control characters")
    if url.startswith("/") or url.lower().startswith("file:"):
        return _check_local(url, local_roots)
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise _refuse("source.url must be an https:// URL (ssh and scp-like addresses such as git@host:repo "
                      "are not supported)")
    scheme = scheme.lower()
    if scheme == "https" or (scheme == "http" and allow_http):
        return _check_web(url, allow_private=allow_http)
    if scheme == "http":
        raise _refuse("source.url must use https:// (plain http is not accepted by this deployment)")
    shown = scheme[:20] if re.fullmatch(r"[a-z0-9+.-]+", scheme) else "this"
    raise _refuse(f"source.url: the {shown} scheme is not supported; use an https:// URL")


def _private_host(host: str) -> bool:
    """A host a tenant must not make the service fetch from: localhost, or a loopback, private, link-local or
    otherwise reserved IP literal (a cloud metadata endpoint, the service's own network)."""
    bare = host.strip("[]")
    if bare == "localhost" or bare.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        return False
    return ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved or ip.is_multicast or ip.is_unspecified


def _check_web(url: str, *, allow_private: bool = False) -> str:
    parts = urlsplit(url)
    if "@" in parts.netloc:
        raise _refuse("put the token in source.token, not in the URL")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise _refuse("source.url must not have a query or a fragment")
    try:
        port = parts.port
    except ValueError:
        raise _refuse("source.url has an invalid port") from None
    host = (parts.hostname or "").lower()
    if host.startswith("[") or ":" in host:  # an IPv6 literal (hostname drops the brackets)
        if not re.fullmatch(r"[0-9a-f:.]+", host):
            raise _refuse("source.url has an invalid host")
        host = f"[{host}]"
    elif not host or len(host) > 253 or not _HOST.match(host):
        raise _refuse("source.url has an invalid host")
    if not allow_private and _private_host(host):
        raise _refuse("source.url names a loopback, private or reserved address (allowed only with MEMEX_KB_ALLOW_HTTP, "
                      "for development)")
    netloc = host if port is None else f"{host}:{port}"
    return f"{parts.scheme.lower()}://{netloc}{parts.path.rstrip('/')}"


def _local_path_of(url: str) -> str:
    """The path named by a local source (``/abs/path`` or ``file:///abs/path``), not yet resolved."""
    if not url.lower().startswith("file:"):
        return url
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise _refuse("a file: source.url must be file:///absolute/path")
    return unquote(parts.path)


def _check_local(url: str, local_roots: tuple[str, ...]) -> str:
    path = _local_path_of(url)
    if not path.startswith("/"):
        raise _refuse("a local source must be an absolute path")
    if not local_roots:
        raise _refuse(f"local paths are not accepted as sources by this deployment ({LOCAL_ROOTS_SETTING} is empty)")
    real = os.path.realpath(path)
    for root in local_roots:
        base = os.path.realpath(root)
        if real == base or real.startswith(base.rstrip(os.sep) + os.sep):
            return real
    raise _refuse(f"local sources must be inside one of the folders of {LOCAL_ROOTS_SETTING}")


# -- the mirror ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Change:
    kind: str  # "add" | "modify" | "delete"
    path: str  # posix path inside the repository
    blob: str | None  # the new blob's sha (hex) for add/modify; None for delete


def _is_file(mode: int | None) -> bool:
    return mode is not None and stat.S_ISREG(mode)


def _is_gitlink(mode: int | None) -> bool:
    return mode is not None and stat.S_IFMT(mode) == 0o160000


def _decode(path: bytes) -> str:
    return path.decode("utf-8", errors="replace")


def _change(ch: TreeChange) -> Change | None:
    """A change of regular files only: a symlink or submodule appearing or going is no change of ours."""
    old = ch.old if ch.old is not None and _is_file(ch.old.mode) else None
    new = ch.new if ch.new is not None and _is_file(ch.new.mode) else None
    if old is not None and new is not None:
        if old.sha == new.sha:  # only the mode changed (the executable bit)
            return None
        return Change("modify", _decode(new.path), new.sha.decode("ascii"))
    if new is not None:
        return Change("add", _decode(new.path), new.sha.decode("ascii"))
    if old is not None:
        return Change("delete", _decode(old.path), None)
    return None


class GitSource:
    """A local bare mirror of one branch of a remote (or local) repository, kept under cache_dir.

    Layout: ``cache_dir/mirror.git`` (the bare repository), ``cache_dir/mirror.url`` (the URL it mirrors, never
    the token) and ``cache_dir/mirror.lock``. Synchronous: run it in a thread.
    """

    def __init__(self, cache_dir: Path, url: str, branch: str = "main", *, token: str | None = None,
                 timeout: float = 60.0) -> None:
        self.cache_dir = Path(cache_dir)
        self.url = url
        self.branch = branch
        self.timeout = timeout
        self._token = token or None
        self._ref = Ref(HEADS + branch.encode("utf-8"))
        self._repo: Repo | None = None
        self._sizes: dict[ObjectID, int] = {}
        scheme = url.partition("://")[0].lower() if "://" in url else ""
        if scheme not in ("", "file", "http", "https"):
            raise SourceError(f"unsupported source URL scheme {scheme[:20]!r}")
        try:
            self._local = _local_path_of(url) if scheme in ("", "file") else None
        except InvalidInput as exc:
            raise SourceError(exc.message) from None

    def __repr__(self) -> str:
        return f"GitSource({self.url!r}, branch={self.branch!r}, token={'set' if self._token else 'none'})"

    def __enter__(self) -> GitSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the mirror's open files (pack files)."""
        if self._repo is not None:
            self._repo.close()
            self._repo = None

    # -- fetching --------------------------------------------------------------------------------------

    def fetch(self) -> str:
        """Create the mirror on first use, else fetch; the branch's head commit sha (hex)."""
        with self._locked():
            try:
                return self._fetch_repairing()
            except SourceError:
                self.close()
                raise

    def _fetch_repairing(self) -> str:
        try:
            return self._fetch_into(self._mirror(fresh=False))
        except SourceError:
            raise
        except Exception:  # a damaged mirror (missing objects, unreadable packs): start again from an empty one
            self.close()
        try:
            return self._fetch_into(self._mirror(fresh=True))
        except SourceError:
            raise
        except Exception as exc:
            raise SourceError(self._scrub(f"could not fetch {self.url}: {type(exc).__name__}: {exc}")) from None

    def _fetch_into(self, repo: Repo) -> str:
        seen: dict[Ref, ObjectID] = {}

        def wants(refs: Mapping[Ref, ObjectID], depth: int | None = None) -> list[ObjectID]:
            seen.update((k, v) for k, v in refs.items() if k.startswith(HEADS) and v is not None)
            sha = refs.get(self._ref)
            return [sha] if sha is not None and sha not in repo.object_store else []

        client, path = self._client()
        try:
            client.fetch(path, repo, determine_wants=wants, ref_prefix=[HEADS])
        except _REMOTE_ERRORS as exc:
            raise SourceError(self._describe(exc)) from None
        finally:
            client.close()
        head = seen.get(self._ref)
        if head is None:
            raise SourceError(self._missing_branch(seen))
        self._check_complete(repo, head)
        repo.refs[self._ref] = head  # overwritten, not fast-forwarded: a force-push is followed
        repo.refs.set_symbolic_ref(Ref(b"HEAD"), self._ref)
        return head.decode("ascii")

    def _client(self) -> tuple[GitClient, str]:
        if self._local is not None:
            return LocalGitClient(), self._local
        user = TOKEN_USERNAME if self._token else None
        client = Urllib3HttpGitClient(self.url, config=None, username=user, password=self._token, timeout=self.timeout)
        return client, urlsplit(self.url).path

    @staticmethod
    def _check_complete(repo: Repo, head: ObjectID) -> None:
        """The head commit and every object of its tree are in the mirror (else it is damaged)."""
        store = repo.object_store
        try:
            commit = store[head]
            if not isinstance(commit, Commit):
                raise _Damaged(head)
            for entry in iter_tree_contents(store, commit.tree):
                if not stat.S_ISDIR(entry.mode or 0) and not _is_gitlink(entry.mode) and entry.sha not in store:
                    raise _Damaged(entry.sha)
        except KeyError as exc:
            raise _Damaged(str(exc)) from None

    def _missing_branch(self, heads: Mapping[Ref, ObjectID]) -> str:
        names = sorted(_decode(ref[len(HEADS):]) for ref in heads)
        if not names:
            return self._scrub(f"branch {self.branch!r} not found: {self.url} has no branches")
        shown = ", ".join(names[:BRANCHES_SHOWN])
        more = f" (and {len(names) - BRANCHES_SHOWN} more)" if len(names) > BRANCHES_SHOWN else ""
        return self._scrub(f"branch {self.branch!r} not found in {self.url}; its branches: {shown}{more}")

    def _describe(self, exc: BaseException) -> str:
        if isinstance(exc, HTTPUnauthorized):
            text = (f"{self.url} refused the credentials (check source.token)" if self._token
                    else f"{self.url} requires authentication: set source.token")
        elif isinstance(exc, HTTPProxyUnauthorized):
            text = f"the HTTP proxy refused to connect to {self.url}"
        elif isinstance(exc, NotGitRepository):
            text = f"no git repository at {self.url}"
        else:
            text = f"could not fetch {self.url}: {exc or type(exc).__name__}"
        return self._scrub(text)

    def _scrub(self, text: str) -> str:
        """``text`` without the token, in any form it could take on the wire."""
        token = self._token
        if not token:
            return text
        basic = f"{TOKEN_USERNAME}:{token}".encode()
        forms = {token, quote(token, safe=""), quote(token), base64.b64encode(basic).decode(),
                 base64.urlsafe_b64encode(basic).decode(), base64.b64encode(token.encode()).decode()}
        for form in sorted(forms, key=len, reverse=True):
            text = text.replace(form, "***")
        return text

    # -- the mirror on disk ----------------------------------------------------------------------------

    @property
    def _mirror_path(self) -> Path:
        return self.cache_dir / MIRROR_DIR

    @property
    def _url_path(self) -> Path:
        return self.cache_dir / URL_FILE

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with open(self.cache_dir / LOCK_FILE, "a+b") as fh:
            if fcntl is not None:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                if fcntl is not None:
                    fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    def _recorded_url(self) -> str | None:
        try:
            return self._url_path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return None

    def _open_existing(self) -> Repo | None:
        """The mirror made for this URL, if it opens; None otherwise."""
        if not self._mirror_path.is_dir() or self._recorded_url() != self.url:
            return None
        try:
            repo = Repo(str(self._mirror_path))
        except Exception:  # not a repository any more: re-cloned by the caller
            return None
        if not repo.bare:
            repo.close()
            return None
        return repo

    def _mirror(self, *, fresh: bool) -> Repo:
        if self._repo is not None and not fresh:
            return self._repo
        self.close()
        if not fresh:
            self._repo = self._open_existing()
            if self._repo is not None:
                return self._repo
        shutil.rmtree(self._mirror_path, ignore_errors=True)
        self._url_path.unlink(missing_ok=True)
        self._repo = Repo.init_bare(str(self._mirror_path), mkdir=True)
        self._url_path.write_text(self.url + "\n", encoding="utf-8")
        return self._repo

    def _store(self) -> Repo:
        if self._repo is None:
            self._repo = self._open_existing()
        if self._repo is None:
            raise SourceError(f"no mirror of {self.url} yet: fetch first")
        return self._repo

    # -- reading ---------------------------------------------------------------------------------------

    def _commit(self, sha: str) -> Commit:
        try:
            obj = self._store().object_store[ObjectID(sha.encode("ascii"))] if _SHA.match(sha) else None
        except KeyError:
            obj = None
        if not isinstance(obj, Commit):
            raise SourceError(f"commit {sha[:64]!r} is not in the mirror of {self.url}")
        return obj

    def has_commit(self, sha: str) -> bool:
        try:
            self._commit(sha)
        except SourceError:
            return False
        return True

    def is_ancestor(self, old: str, new: str) -> bool:
        """Whether ``old`` is reachable from ``new`` (a force-push makes this False)."""
        if not (self.has_commit(old) and self.has_commit(new)):
            return False
        target, store = ObjectID(old.encode("ascii")), self._store().object_store
        todo, seen = [ObjectID(new.encode("ascii"))], set()
        while todo:
            sha = todo.pop()
            if sha == target:
                return True
            if sha in seen:
                continue
            seen.add(sha)
            try:
                commit = store[sha]
            except KeyError:  # a parent the mirror lacks (it never should)
                continue
            if isinstance(commit, Commit):
                todo.extend(commit.parents)
        return False

    def _entries(self, commit: str) -> Iterator[tuple[str, int, ObjectID]]:
        store = self._store().object_store
        try:
            for entry in iter_tree_contents(store, self._commit(commit).tree):
                if entry.path is None or entry.mode is None or entry.sha is None:
                    continue
                yield _decode(entry.path), entry.mode, entry.sha
        except KeyError as exc:
            raise SourceError(f"the mirror of {self.url} lacks an object ({exc}): fetch again") from None

    def files(self, commit: str) -> dict[str, tuple[str, int]]:
        """Every regular file of the commit's tree: path -> (blob sha, size). No symlinks, no submodules."""
        return {path: (sha.decode("ascii"), self._size(sha))
                for path, mode, sha in self._entries(commit) if _is_file(mode)}

    def symlinks(self, commit: str) -> list[str]:
        return [path for path, mode, _ in self._entries(commit) if stat.S_ISLNK(mode)]

    def _size(self, sha: ObjectID) -> int:
        size = self._sizes.get(sha)
        if size is None:
            try:
                size = len(self._store().object_store.get_raw(sha)[1])
            except KeyError:
                raise SourceError(f"blob {sha.decode('ascii')} is not in the mirror of {self.url}") from None
            self._sizes[sha] = size
        return size

    def diff(self, old: str, new: str) -> list[Change]:
        """Changes of regular files between the two commits' trees (a rename is a delete plus an add)."""
        old_tree, new_tree = self._commit(old).tree, self._commit(new).tree
        try:
            changes = [_change(ch) for ch in tree_changes(self._store().object_store, old_tree, new_tree)]
        except KeyError as exc:
            raise SourceError(f"the mirror of {self.url} lacks an object ({exc}): fetch again") from None
        return [c for c in changes if c is not None]

    def read(self, blob: str) -> bytes:
        try:
            obj = self._store().object_store[ObjectID(blob.encode("ascii"))] if _SHA.match(blob) else None
        except KeyError:
            obj = None
        if not isinstance(obj, Blob):
            raise SourceError(f"blob {blob[:64]!r} is not in the mirror of {self.url}")
        return obj.data

