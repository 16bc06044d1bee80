"""Test helpers for knowledge bases: git repositories built with dulwich only (no git binary), a git smart-HTTP
server on loopback, a fixed fixture vault and generated vaults for benchmarks.

The fixture vault is the fictional Larchwood Commons, a land and energy cooperative. It follows the seed's layout
(docs/<group>/ with a frontmatter ``type``, data/<bucket>/ typed by folder, releases marked by ``index.base``),
holds a published entry of each of the 18 content types, wikilinks of every form, and a set of problem files
the sync must report one by one. The constants below name what tests look for; an entry's id is its file name
without ``.md`` (``index.md``: its folder's name).
"""

from __future__ import annotations

import base64
import contextlib
import hmac
import json
import os
import random
import re
import stat
import struct
import threading
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import make_server

from dulwich.errors import NotGitRepository
from dulwich.index import Index, IndexEntry, commit_tree, index_entry_from_stat
from dulwich.object_store import iter_tree_contents
from dulwich.objects import Blob, Commit
from dulwich.repo import Repo
from dulwich.server import Backend
from dulwich.web import WSGIRequestHandlerLogger, WSGIServerLogger, make_wsgi_chain

__all__ = [
    "GitVault", "serve_git_http", "vault_files", "generated_vault", "frontmatter", "CONTENT_TYPES", "GROUPS", "TYPES_BY_ID",
    "PATHS_BY_ID", "KEYWORDS", "GROUP_OF", "STATUS_OF", "RELEASES", "RELEASE_OF", "LINKS", "EMBEDS",
    "UNRESOLVED_TARGETS", "UNRESOLVED_LINKS", "PROBLEM_FILES", "DUPLICATE_ID", "INVALID_FIELDS", "ALIASED_TYPES",
    "HUGE_FILE", "LATIN1_FILE", "BROKEN_YAML_FILE", "ATTACHMENT", "MAX_ENTRY_BYTES",
]

# -- git repositories without git --------------------------------------------------------------------------

AUTHOR = b"Larchwood Fixture <fixture@larchwood.example>"
#: Commit times: EPOCH, then one minute more per commit of the vault.
EPOCH = 1_700_000_000
REGULAR = stat.S_IFREG | 0o644
SYMLINK = stat.S_IFLNK
GITLINK = 0o160000


class GitVault:
    """A git repository on disk built with dulwich only (no git binary), on branch `main` by default."""

    def __init__(self, path: Path, branch: str = "main") -> None:
        self.path = Path(path)
        self.branch = branch
        self.path.mkdir(parents=True, exist_ok=True)
        self.repo = Repo.init(str(self.path), default_branch=branch.encode())
        self._index = Index(self.path / ".git" / "index", read=False)
        self._ticks = 0

    def __repr__(self) -> str:
        return f"GitVault({str(self.path)!r}, branch={self.branch!r})"

    def close(self) -> None:
        self.repo.close()

    def _ref(self, branch: str | None = None) -> bytes:
        return b"refs/heads/" + (branch or self.branch).encode()

    def _stage(self, rel: str, blob: Blob, mode: int | None = None) -> None:
        self.repo.object_store.add_object(blob)
        st = os.lstat(self.path / rel)
        self._index[rel.encode()] = index_entry_from_stat(st, blob.id, mode=mode)

    def _unstage(self, rel: str) -> None:
        if rel.encode() in self._index:
            del self._index[rel.encode()]

    def _clear(self, rel: str) -> Path:
        target = self.path / rel
        if target.is_dir() and not target.is_symlink():
            target.rmdir()  # an (empty) submodule folder
        elif target.is_symlink() or target.exists():
            target.unlink()
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def write(self, files: Mapping[str, bytes | str | None]) -> None:
        """Write (str encoded as UTF-8) or delete (None) files in the working tree, and stage them."""
        for rel, content in files.items():
            target = self._clear(rel)
            if content is None:
                self._unstage(rel)
                continue
            data = content.encode("utf-8") if isinstance(content, str) else content
            target.write_bytes(data)
            self._stage(rel, Blob.from_string(data), REGULAR)
        self._index.write()

    def symlink(self, path: str, target: str) -> None:
        """A staged symlink at ``path`` pointing to ``target``."""
        os.symlink(target, self._clear(path))
        self._stage(path, Blob.from_string(target.encode()), SYMLINK)
        self._index.write()

    def submodule(self, path: str, commit: str) -> None:
        """A staged submodule (a gitlink to ``commit`` of another repository; nothing is checked out)."""
        self._clear(path).mkdir()
        self._index[path.encode()] = IndexEntry(ctime=0, mtime=0, dev=0, ino=0, mode=GITLINK, uid=0, gid=0, size=0,
                                                sha=commit.encode())
        self._index.write()

    def rename(self, old: str, new: str) -> None:
        """Move a tracked file (staged)."""
        entry = self._index[old.encode()]
        destination = self._clear(new)
        os.replace(self.path / old, destination)
        del self._index[old.encode()]
        self._index[new.encode()] = index_entry_from_stat(os.lstat(destination), entry.sha, mode=entry.mode)
        self._index.write()

    def _commit_tree(self, tree: bytes, parents: list[bytes], message: str, branch: str | None = None) -> str:
        self._ticks += 1
        commit = Commit()
        commit.tree = tree
        commit.parents = parents
        commit.author = commit.committer = AUTHOR
        commit.author_time = commit.commit_time = EPOCH + 60 * self._ticks
        commit.author_timezone = commit.commit_timezone = 0
        commit.encoding = b"UTF-8"
        commit.message = message.encode("utf-8") + b"\n"
        self.repo.object_store.add_object(commit)
        self.repo.refs[self._ref(branch)] = commit.id
        return commit.id.decode("ascii")

    def _parents(self, branch: str | None = None) -> list[bytes]:
        ref = self._ref(branch)
        return [self.repo.refs[ref]] if ref in self.repo.refs else []

    def commit(self, message: str = "update") -> str:
        """Commit what is staged; the new commit's sha (hex)."""
        tree = commit_tree(self.repo.object_store, self._index.iterobjects())
        return self._commit_tree(tree, self._parents(), message)

    def head(self) -> str:
        return self.repo.refs[self._ref()].decode("ascii")

    def reset_hard(self, sha: str) -> None:
        """Move the branch, the index and the working tree to ``sha`` (then a new commit simulates a force-push)."""
        commit = self.repo.object_store[sha.encode()]
        assert isinstance(commit, Commit)
        for rel in list(self._index.paths()):
            self._clear(rel.decode())
        self._index.clear()
        self.repo.refs[self._ref()] = commit.id
        store = self.repo.object_store
        for entry in iter_tree_contents(store, commit.tree):
            assert entry.path is not None and entry.mode is not None and entry.sha is not None
            rel, data = entry.path.decode(), store[entry.sha].as_raw_string()
            target = self._clear(rel)
            if entry.mode == GITLINK:
                target.mkdir()
                self._index[entry.path] = IndexEntry(ctime=0, mtime=0, dev=0, ino=0, mode=GITLINK, uid=0, gid=0, size=0,
                                                     sha=entry.sha)
                continue
            if stat.S_ISLNK(entry.mode):
                os.symlink(data.decode(), target)
            else:
                target.write_bytes(data)
            self._index[entry.path] = index_entry_from_stat(os.lstat(target), entry.sha, mode=entry.mode)
        self._index.write()

    def commit_on_branch(self, branch: str, files: Mapping[str, bytes | str | None], message: str = "update") -> str:
        """A commit on another branch (created from this one's head), leaving the working tree alone."""
        parents = self._parents(branch) or self._parents()
        store = self.repo.object_store
        entries: dict[bytes, tuple[bytes, int]] = {}
        if parents:
            base = store[parents[0]]
            assert isinstance(base, Commit)
            entries = {e.path: (e.sha, e.mode) for e in iter_tree_contents(store, base.tree)}  # type: ignore[misc]
        for rel, content in files.items():
            if content is None:
                entries.pop(rel.encode(), None)
                continue
            blob = Blob.from_string(content.encode("utf-8") if isinstance(content, str) else content)
            store.add_object(blob)
            entries[rel.encode()] = (blob.id, REGULAR)
        tree = commit_tree(store, [(path, sha, mode) for path, (sha, mode) in entries.items()])
        return self._commit_tree(tree, parents, message, branch)


# -- git over smart HTTP on loopback -----------------------------------------------------------------------


class _OneRepoBackend(Backend):
    """Serves one repository at one URL path, opened afresh per request (it sees every new commit)."""

    def __init__(self, root: Path, prefix: str) -> None:
        self.root, self.prefix = root, prefix
        self._opened: list[Repo] = []
        self._lock = threading.Lock()

    def open_repository(self, path: str | bytes) -> Repo:  # type: ignore[override]
        name = path.decode() if isinstance(path, bytes) else path
        if name.rstrip("/") != self.prefix:
            raise NotGitRepository(f"no repository at {name}")
        repo = Repo(str(self.root))
        with self._lock:
            self._opened.append(repo)
        return repo

    def close(self) -> None:
        with self._lock:
            for repo in self._opened:
                repo.close()
            self._opened.clear()


def _basic_auth(app: Any, token: str) -> Any:
    """A WSGI middleware: HTTP basic auth whose password must equal ``token`` (any user name)."""

    def guarded(environ: dict[str, Any], start_response: Any) -> Any:
        scheme, _, value = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme.lower() == "basic":
            try:
                password = base64.b64decode(value, validate=True).decode("utf-8").partition(":")[2]
            except ValueError:
                password = ""
            if hmac.compare_digest(password.encode(), token.encode()):
                return app(environ, start_response)
        body = b"authentication required\n"
        start_response("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="git"'), ("Content-Type", "text/plain"),
                                            ("Content-Length", str(len(body)))])
        return [body]

    return guarded


class _Server(ThreadingMixIn, WSGIServerLogger):
    daemon_threads = True


@contextlib.contextmanager
def serve_git_http(repo_path: Path, *, token: str | None = None) -> Iterator[str]:
    """Serve ``repo_path`` over git smart HTTP on 127.0.0.1 (dulwich.web); yields the repository's URL. With a
    token, every request needs HTTP basic auth whose password is the token (401 otherwise)."""
    prefix = "/vault.git"
    backend = _OneRepoBackend(Path(repo_path), prefix)
    app = make_wsgi_chain(backend)
    if token is not None:
        app = _basic_auth(app, token)
    server = make_server("127.0.0.1", 0, app, server_class=_Server, handler_class=WSGIRequestHandlerLogger)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}{prefix}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
        backend.close()


# -- the fixture vault ----------------------------------------------------------------------------------------

CONTENT_TYPES = ("file", "reference", "index", "link", "tag", "pattern", "practice", "primitive", "protocol",
                 "playbook", "question", "study", "article", "person", "group", "project", "place", "gathering")
GROUPS = ("stewardship-circle", "commons-lab", "treasury-guild")
#: The sync's per-file size limit the huge file is above.
MAX_ENTRY_BYTES = 1024 * 1024

HUGE_FILE = "data/stories/articles/huge-article.md"
LATIN1_FILE = "data/people/latin1-person.md"
BROKEN_YAML_FILE = "data/concepts/broken-yaml.md"
ATTACHMENT = "attachments/diagram.png"
DUPLICATE_ID = "shared-name"

#: Files the sync reports one by one (path -> which problem). None of them is in TYPES_BY_ID.
PROBLEM_FILES: dict[str, str] = {
    BROKEN_YAML_FILE: "malformed_yaml",
    "data/questions/unasked-question.md": "unpublished",  # publish: false
    "data/links/bookmark-without-publish.md": "no_publish",
    "data/stories/articles/draft-essay.md": "draft",  # publish: true, draft: true
    "data/resources/patterns/shared-name.md": "duplicate_id",
    "docs/commons-lab/shared-name.md": "duplicate_id",
    HUGE_FILE: "too_large",  # above MAX_ENTRY_BYTES
    LATIN1_FILE: "not_utf8",  # a Latin-1 é
    "drafts/unfinished-idea.md": "drafts_folder",  # published, but drafts/ is excluded
    ".obsidian/workspace.json": "dot_folder",
    ".obsidian/app.json": "dot_folder",
    ATTACHMENT: "attachment",  # binary, embedded by lab-index as ![[diagram.png]]
    "docs/stewardship-circle/stewardship.md": "type_alias",  # type: concept (an alias of tag)
    "data/gatherings/harvest-fair.md": "invalid_date",  # date: not-a-date
    "data/links/broken-url-link.md": "invalid_url",  # url: not a url
}
#: Problem files whose problem is one field's value (path -> field): kept with a warning or refused, as the
#: ontology decides (``date`` is required by the seed's FileSchema, ``url`` by its LinkSchema).
INVALID_FIELDS: dict[str, str] = {"data/gatherings/harvest-fair.md": "date", "data/links/broken-url-link.md": "url"}
#: Problem files with a type alias: path -> (the type written, the canonical type).
ALIASED_TYPES: dict[str, tuple[str, str]] = {"docs/stewardship-circle/stewardship.md": ("concept", "tag")}

#: Release folders (holding an index.base) -> the release: its id (the folder's name), title and parent id.
RELEASES: dict[str, dict[str, str | None]] = {
    "docs/commons-lab/field-kit-2024": {"id": "field-kit-2024", "title": "Field Kit 2024", "parent": None},
    "docs/commons-lab/field-kit-2024/water-module": {"id": "water-module", "title": "Water Module",
                                                      "parent": "field-kit-2024"},
    "docs/treasury-guild/budget-handbook": {"id": "budget-handbook", "title": "Budget Handbook", "parent": None},
}

# Entries: id -> (path, content type written in the frontmatter or None for data/, a keyword found in no other
# file, title, frontmatter fields beyond title/date/description/tags/publish, body).
_Spec = tuple[str, str | None, str, str, dict[str, Any], str]


def _specs() -> dict[str, _Spec]:
    sc, cl, tg = GROUPS
    return {
        # docs/stewardship-circle
        "meeting-cadence": (
            f"docs/{sc}/meeting-cadence.md", "file", "fortnightly", "Meeting Cadence",
            {"group": sc, "author": ["ada-okonkwo"]},
            "The circle meets fortnightly on Tuesday evenings in the old granary.\n\n"
            "## Rhythm\n\nEach meeting opens with a check-in, then the agenda drawn from the shared board. "
            "The role of facilitator changes every meeting, as described in [[rotating-facilitation#Solution]], "
            "and decisions need the presence defined in [[quorum]].\n"),
        "bylaws-reference": (
            f"docs/{sc}/bylaws-reference.md", "reference", "amendment", "Bylaws Reference",
            {"group": sc},
            "A plain-language map of the cooperative's bylaws, clause by clause.\n\n"
            "## Changing the bylaws\n\nAny amendment is tabled at one general meeting and voted at the next, "
            "with two thirds of the votes cast.\n"),
        # docs/commons-lab
        "lab-index": (
            f"docs/{cl}/lab-index.md", "index", "signpost", "Commons Lab Index",
            {"group": cl},
            "This page is the signpost for everything the lab publishes.\n\n"
            "- The release [[field-kit-2024]] gathers our practical guides.\n"
            "- [[seed-library|The seed library pattern]] started the lab.\n"
            "- Read [the meeting cadence](../stewardship-circle/meeting-cadence.md) before joining a session.\n\n"
            "![[diagram.png]]\n"),
        "seed-library": (
            f"docs/{cl}/seed-library.md", "pattern", "germination", "Seed Library",
            {"group": cl, "context": "Households save seed but rarely swap it.",
             "problem": "Local varieties disappear when one grower stops.",
             "solution": "Keep a lending library of seed, returned after harvest.",
             "relatedPatterns": ["rotating-facilitation"]},
            "Members borrow a packet in spring and return twice as much after harvest. Germination tests run "
            "every winter on a damp cloth in the lab's back room.\n"),
        # the release docs/commons-lab/field-kit-2024 and its nested water-module
        "field-kit-2024": (
            f"docs/{cl}/field-kit-2024/index.md", "index", "toolkit", "Field Kit 2024",
            {"group": cl},
            "The 2024 toolkit for working the shared land: [[soil-testing]], [[tool-lending]] and the "
            "[[water-module]].\n"),
        "soil-testing": (
            f"docs/{cl}/field-kit-2024/soil-testing.md", "practice", "nitrogen", "Soil Testing",
            {"group": cl, "patterns": ["seed-library"], "practitioners": ["ada-okonkwo"]},
            "Each autumn plots are sampled at three depths. The kit measures pH, phosphorus and nitrogen, "
            "and results go on the plot's card.\n"),
        "tool-lending": (
            f"docs/{cl}/field-kit-2024/tool-lending.md", "protocol", "borrowing", "Tool Lending Protocol",
            {"group": cl, "steps": ["Sign the card", "Take the tool", "Clean and return within a week"]},
            "Borrowing a tool takes a signature on its card; the shed keeper checks returns on Sundays.\n"),
        "water-module": (
            f"docs/{cl}/field-kit-2024/water-module/index.md", "index", "irrigation", "Water Module",
            {"group": cl},
            "Guides on irrigation for the dry months: [[rain-catchment]] and [[greywater-study]].\n"),
        "rain-catchment": (
            f"docs/{cl}/field-kit-2024/water-module/rain-catchment.md", "primitive", "cistern", "Rain Catchment",
            {"group": cl, "category": "infrastructure"},
            "Every roof drains into a shared cistern of twelve cubic metres, filtered through gravel.\n"),
        "greywater-study": (
            f"docs/{cl}/field-kit-2024/water-module/greywater-study.md", "study", "washhouse",
            "Greywater in the Orchard",
            {"group": cl},
            "Two seasons of reusing greywater from the washhouse on fruit trees, with water from "
            "[[rain-catchment]] as the control.\n"),
        # docs/treasury-guild and its release budget-handbook
        "surplus-question": (
            f"docs/{tg}/surplus-question.md", "question", "surplus", "Where Should a Surplus Go?",
            {"group": tg, "status": "exploring", "proposedBy": ["ada-okonkwo"]},
            "When the year closes above budget, should the surplus return to members or grow the "
            "[[reserve-fund]]? See also [the dues](budget-handbook/dues-schedule.md).\n"),
        "budget-handbook": (
            f"docs/{tg}/budget-handbook/index.md", "index", "appropriations", "Budget Handbook",
            {"group": tg},
            "How the guild prepares appropriations each year: the [[reserve-fund]] and the [[dues-schedule]].\n"),
        "reserve-fund": (
            f"docs/{tg}/budget-handbook/reserve-fund.md", "playbook", "contingency", "Reserve Fund Playbook",
            {"group": tg},
            "Six months of running costs stay in a contingency account; drawing on it needs two signatures.\n"),
        "dues-schedule": (
            f"docs/{tg}/budget-handbook/dues-schedule.md", "reference", "sliding", "Dues Schedule",
            {"group": tg},
            "Monthly dues follow a sliding scale from four to forty credits, reviewed every January.\n"),
        # data/
        "quorum": (
            "data/concepts/quorum.md", None, "abstention", "Quorum",
            {"aliases": ["minimum attendance", "quorum threshold"], "relatedTerms": ["consent", "supermajority"],
             "category": "governance"},
            "The smallest share of members whose presence makes an assembly's decisions binding.\n\n"
            "## Thresholds\n\nA general meeting needs a third of members; a circle needs half of its own. "
            "An abstention counts as presence. Decisions then follow [[consent-rounds|consent rounds]].\n"),
        "mutual-aid-ledger": (
            "data/links/mutual-aid-ledger.md", None, "reconciliation", "Mutual Aid Ledger",
            {"url": "https://ledger.larchwood.example/aid"},
            "An open tool for tracking favours between households, with a monthly reconciliation view.\n"),
        "rotating-facilitation": (
            "data/resources/patterns/rotating-facilitation.md", None, "baton", "Rotating Facilitation",
            {"group": sc, "context": "Small assemblies with a few confident voices.",
             "problem": "The same people always chair and the rest disengage.",
             "solution": "Pass the facilitator role to a different member at each meeting.",
             "relatedPatterns": ["consent-rounds"]},
            "## Solution\n\nThe outgoing facilitator hands a wooden baton to the next person on the roster. "
            "It keeps [[quorum]] rules visible, and the reasons are told in [[why-we-rotate-roles]].\n"),
        "consent-rounds": (
            "data/resources/practices/consent-rounds.md", None, "objection", "Consent Rounds",
            {"group": sc, "patterns": ["rotating-facilitation"]},
            "A proposal passes when no member raises a reasoned objection in a round. The round is led as in "
            "[[rotating-facilitation]].\n"),
        "shared-treasury-multisig": (
            "data/resources/primitives/shared-treasury-multisig.md", None, "cosigners", "Shared Treasury Multisig",
            {"group": tg, "category": "finance"},
            "The treasury wallet needs three of five cosigners, drawn from different circles.\n"),
        "dispute-mediation": (
            "data/resources/protocols/dispute-mediation.md", None, "ombudsperson", "Dispute Mediation Protocol",
            {"steps": ["Talk directly", "Ask a peer", "Bring in the ombudsperson", "Refer to the assembly"]},
            "Conflicts climb four steps; the elected ombudsperson listens at the third.\n"),
        "onboarding-playbook": (
            "data/resources/playbooks/onboarding-playbook.md", None, "mentorship", "Onboarding Playbook",
            {"release": "field-kit-2024"},
            "New members get six months of mentorship from an existing household and a tour of the plots.\n"),
        "how-to-weight-votes": (
            "data/questions/how-to-weight-votes.md", None, "quadratic", "How Should Votes Be Weighted?",
            {"status": "open", "related": ["quorum"]},
            "Would quadratic voting fit budget decisions better than one member one vote? It would change the "
            "[[quorum#Thresholds]] arithmetic.\n"),
        "orchard-buyout": (
            "data/stories/studies/orchard-buyout.md", None, "cider", "The Orchard Buyout",
            {"release": "field-kit-2024"},
            "How thirty households bought the abandoned orchard in 2019 and paid the loan back with cider sales.\n"),
        "why-we-rotate-roles": (
            "data/stories/articles/why-we-rotate-roles.md", None, "burnout", "Why We Rotate Roles",
            {"author": ["ada-okonkwo"], "curator": "stewardship-circle"},
            "Three secretaries in a row left in exhaustion; rotation was our answer to burnout.\n"),
        "ada-okonkwo": (
            "data/people/ada-okonkwo.md", None, "beekeeper", "Ada Okonkwo",
            {"roles": ["founding member", "facilitator"], "groups": ["stewardship-circle"],
             "homepage": "https://ada.larchwood.example"},
            "Ada is the cooperative's beekeeper and sits on the [[stewardship-circle]].\n"),
        "stewardship-circle": (
            "data/groups/stewardship-circle.md", None, "custodians", "Stewardship Circle",
            {"slug": "stewardship-circle", "members": ["ada-okonkwo"]},
            "The elected custodians of the bylaws and of the meeting calendar.\n"),
        "solar-canopy": (
            "data/projects/solar-canopy.md", None, "photovoltaic", "Solar Canopy",
            {"group": cl, "status": "active", "startDate": "2024-04-01", "lead": ["ada-okonkwo"]},
            "A photovoltaic canopy over the car park of [[larchwood-valley]], led by [[ada-okonkwo|Ada]]. Funding "
            "follows the [[participatory-budget-ledger]].\n"),
        "larchwood-valley": (
            "data/places/larchwood-valley.md", None, "watershed", "Larchwood Valley",
            {"region": "Northern uplands", "geo": "52.1,-1.4"},
            "The valley's watershed feeds the cooperative's wells and the brook along the orchard.\n"),
        "spring-assembly-2024": (
            "data/gatherings/spring-assembly-2024.md", None, "potluck", "Spring Assembly 2024",
            {"location": "larchwood-valley", "startDate": "2024-03-23", "endDate": "2024-03-24",
             "outcomes": ["Adopted the solar canopy budget"]},
            "Two days in [[larchwood-valley]] ending with a potluck; it opened the debate on "
            "[[how-to-weight-votes]] and recalled the [[winter-retreat-2019]].\n"),
    }


_DATES = ("2023-09-14", "2023-11-02", "2024-01-18", "2024-02-07", "2024-03-23", "2024-04-30", "2024-06-12")


def _types() -> dict[str, str]:
    folders = {"data/concepts": "tag", "data/links": "link", "data/resources/patterns": "pattern",
               "data/resources/practices": "practice", "data/resources/primitives": "primitive",
               "data/resources/protocols": "protocol", "data/resources/playbooks": "playbook",
               "data/stories/studies": "study", "data/stories/articles": "article", "data/questions": "question",
               "data/people": "person", "data/groups": "group", "data/projects": "project", "data/places": "place",
               "data/gatherings": "gathering"}
    out = {}
    for entry_id, (path, kind, *_rest) in _specs().items():
        out[entry_id] = kind or folders[path.rpartition("/")[0]]
    return out


#: Every published, valid entry (no problem file): id -> content type.
TYPES_BY_ID: dict[str, str] = _types()
PATHS_BY_ID: dict[str, str] = {k: v[0] for k, v in _specs().items()}
#: id -> a word found in that entry and in no other file of the vault (for search tests).
KEYWORDS: dict[str, str] = {k: v[2] for k, v in _specs().items()}
#: id -> its frontmatter ``group``.
GROUP_OF: dict[str, str] = {k: v[4]["group"] for k, v in _specs().items() if "group" in v[4]}
#: id -> its frontmatter ``status``.
STATUS_OF: dict[str, str] = {k: v[4]["status"] for k, v in _specs().items() if "status" in v[4]}
#: id -> the id of the innermost release holding it (index.md files belong to their own release).
RELEASE_OF: dict[str, str] = {
    "field-kit-2024": "field-kit-2024", "soil-testing": "field-kit-2024", "tool-lending": "field-kit-2024",
    "water-module": "water-module", "rain-catchment": "water-module", "greywater-study": "water-module",
    "budget-handbook": "budget-handbook", "reserve-fund": "budget-handbook", "dues-schedule": "budget-handbook",
}
#: id -> the ids its body links to (wikilinks with labels and headings, relative markdown links), resolved.
LINKS: dict[str, set[str]] = {
    "meeting-cadence": {"rotating-facilitation", "quorum"},
    "lab-index": {"field-kit-2024", "seed-library", "meeting-cadence"},
    "field-kit-2024": {"soil-testing", "tool-lending", "water-module"},
    "water-module": {"rain-catchment", "greywater-study"},
    "greywater-study": {"rain-catchment"},
    "surplus-question": {"reserve-fund", "dues-schedule"},
    "budget-handbook": {"reserve-fund", "dues-schedule"},
    "quorum": {"consent-rounds"},
    "rotating-facilitation": {"quorum", "why-we-rotate-roles"},
    "consent-rounds": {"rotating-facilitation"},
    "how-to-weight-votes": {"quorum"},
    "ada-okonkwo": {"stewardship-circle"},
    "solar-canopy": {"larchwood-valley", "ada-okonkwo"},
    "spring-assembly-2024": {"larchwood-valley", "how-to-weight-votes"},
}
#: id -> the attachments it embeds.
EMBEDS: dict[str, list[str]] = {"lab-index": ["diagram.png"]}
#: Link targets that name no entry, and (path of the linking file, target).
UNRESOLVED_TARGETS: frozenset[str] = frozenset({"participatory-budget-ledger", "winter-retreat-2019"})
UNRESOLVED_LINKS: tuple[tuple[str, str], ...] = (
    ("data/projects/solar-canopy.md", "participatory-budget-ledger"),
    ("data/gatherings/spring-assembly-2024.md", "winter-retreat-2019"),
)


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    plain = re.fullmatch(r"\d{4}-\d{2}-\d{2}(T[\d:]+Z?)?|[A-Za-z][\w .,'()/-]*", text)
    if plain and not text.endswith(" ") and text.lower() not in ("true", "false", "yes", "no", "null", "on", "off"):
        return text
    return json.dumps(text, ensure_ascii=False)


def frontmatter(fields: Mapping[str, Any]) -> str:
    """YAML frontmatter as Obsidian writes it (block lists, plain scalars when safe), between ``---`` lines."""
    lines = ["---"]
    for key, value in fields.items():
        if isinstance(value, (list, tuple)):
            lines.append(f"{key}:")
            lines.extend(f"  - {_scalar(v)}" for v in value)
        else:
            lines.append(f"{key}: {_scalar(value)}")
    lines.append("---")
    return "\n".join(lines) + "\n"


def _note(fields: Mapping[str, Any], body: str) -> bytes:
    return (frontmatter(fields) + "\n" + body).encode("utf-8")


def _entry_files() -> dict[str, bytes]:
    out = {}
    for n, (entry_id, (path, kind, keyword, title, extra, body)) in enumerate(_specs().items()):
        fields: dict[str, Any] = {"type": kind} if kind else {}
        fields.update(title=title, date=_DATES[n % len(_DATES)],
                      description=f"{title}: notes of the Larchwood Commons cooperative.",
                      tags=[GROUP_OF.get(entry_id, "larchwood"), TYPES_BY_ID[entry_id]], publish=True)
        fields.update(extra)
        out[path] = _note(fields, f"# {title}\n\n{body}")
        assert keyword in body.lower(), (entry_id, keyword)
    return out


def _release_markers() -> dict[str, bytes]:
    return {f"{folder}/index.base": (f"filters:\n  and:\n    - file.inFolder(\"{folder}\")\nviews:\n  - type: table\n"
                                     f"    name: {release['title']}\n    order:\n      - file.name\n      - date\n").encode()
            for folder, release in RELEASES.items()}


def _png() -> bytes:
    """An 8x8 two-colour PNG, made by code."""
    rows = b"".join(b"\x00" + b"".join(bytes((40 + 180 * ((x + y) % 2), 120, 70)) for x in range(8)) for y in range(8))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def _published(title: str, **extra: Any) -> dict[str, Any]:
    return {"title": title, "date": "2024-05-05", "description": f"{title}, a note of the cooperative.",
            "tags": ["larchwood"], "publish": True, **extra}


def _huge_article() -> bytes:
    paragraph = ("The archive keeps every season's minutes, letters and ledgers, copied by hand and filed by "
                 "month so that later members can follow how each decision came about.\n\n")
    head = frontmatter(_published("Complete Minutes Archive")) + "\n# Complete Minutes Archive\n\n"
    repeats = (MAX_ENTRY_BYTES + 64 * 1024) // len(paragraph) + 1
    return (head + paragraph * repeats).encode("utf-8")


def _problem_files() -> dict[str, bytes]:
    sc, cl, _ = GROUPS
    return {
        BROKEN_YAML_FILE: (b"---\ntitle: Broken lexicon entry\ntags: [governance, lexicon\ndescription: \"unterminated\n"
                           b"publish: true\n---\n\nThis entry's frontmatter does not parse.\n"),
        "data/questions/unasked-question.md": _note(
            {**_published("An Unasked Question"), "publish": False}, "Kept private until the circle discusses it.\n"),
        "data/links/bookmark-without-publish.md": _note(
            {k: v for k, v in _published("A Bookmark").items() if k != "publish"} | {"url": "https://example.org/x"},
            "A link saved without deciding whether to publish it.\n"),
        "data/stories/articles/draft-essay.md": _note(
            _published("A Draft Essay", draft=True), "Half written: published flag set, still a draft.\n"),
        "data/resources/patterns/shared-name.md": _note(
            _published("Shared Name (pattern)"), "A pattern whose file name is also used in the docs.\n"),
        f"docs/{cl}/shared-name.md": _note(
            {"type": "article", **_published("Shared Name (article)", group=cl)},
            "An article whose file name is also used by a pattern.\n"),
        HUGE_FILE: _huge_article(),
        LATIN1_FILE: ("---\ntitle: Zoé Marchand\ndate: 2024-02-02\ndescription: Member profile.\ntags:\n  - people\n"
                      "publish: true\n---\n\nZoé keeps the seed register.\n").encode("latin-1"),
        "drafts/unfinished-idea.md": _note(_published("An Unfinished Idea"), "Not ready: lives in drafts/.\n"),
        ".obsidian/workspace.json": json.dumps({"main": {"type": "split", "children": []}, "active": "lab-index"},
                                               indent=2).encode(),
        ".obsidian/app.json": b'{"attachmentFolderPath": "attachments", "alwaysUpdateLinks": true}\n',
        ATTACHMENT: _png(),
        f"docs/{sc}/stewardship.md": _note(
            {"type": "concept", **_published("Stewardship", group=sc, aliases=["guardianship"])},
            "Stewardship is guardianship of shared things on behalf of those not yet here.\n"),
        "data/gatherings/harvest-fair.md": _note(
            {**_published("Harvest Fair"), "date": "not-a-date"}, "The autumn fair in the orchard.\n"),
        "data/links/broken-url-link.md": _note(
            _published("A Broken Link", url="not a url"), "A link whose url field is not a URL.\n"),
    }


def vault_files() -> dict[str, bytes]:
    """The fixture vault: path -> bytes (deterministic)."""
    files = {**_entry_files(), **_release_markers(), **_problem_files()}
    return dict(sorted(files.items()))


# -- generated vaults (benchmarks) --------------------------------------------------------------------------

_FOLDERS = ("data/concepts", "data/links", "data/resources/patterns", "data/resources/practices",
            "data/resources/primitives", "data/resources/protocols", "data/resources/playbooks", "data/stories/studies",
            "data/stories/articles", "data/questions", "data/people", "data/groups", "data/projects", "data/places",
            "data/gatherings")
_DOC_GROUPS = ("assembly", "field-research", "finance-circle", "housing-lab", "energy-commons")
_UNKNOWN_TYPES = ("memo", "whitepaper", "minutes", "recipe")
_FUNCTION_WORDS = ("the", "of", "and", "to", "a", "in", "is", "that", "for", "it", "as", "with", "on", "by", "this",
                   "be", "are", "from", "or", "at", "which", "an", "was", "not", "we", "can", "each", "our", "when",
                   "their", "more", "into", "all", "how", "who", "between", "where", "than", "over", "after")
_ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "br", "ch", "cl", "dr",
           "gr", "pl", "pr", "sh", "st", "th", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "io", "ou")
_CODAS = ("", "", "n", "r", "s", "l", "m", "t", "nd", "rk", "st", "ng")


def _vocabulary(rng: random.Random, size: int = 4000) -> list[str]:
    """Function words first, then invented words, shorter ones more frequent (Zipf ranks)."""
    words: set[str] = set(_FUNCTION_WORDS)
    invented: list[str] = []
    while len(invented) < size - len(_FUNCTION_WORDS):
        syllables = rng.choices((1, 2, 3, 4), weights=(3, 5, 3, 1))[0]
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
        if word not in words and 3 <= len(word) <= 14:
            words.add(word)
            invented.append(word)
    invented.sort(key=lambda w: (len(w), rng.random()))
    return list(_FUNCTION_WORDS) + invented


def _zipf_weights(size: int, exponent: float = 1.07) -> list[float]:
    total, out = 0.0, []
    for rank in range(1, size + 1):
        total += 1.0 / rank ** exponent
        out.append(total)
    return out


class _Prose:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.vocab = _vocabulary(rng)
        self.cum = _zipf_weights(len(self.vocab))

    def words(self, n: int) -> list[str]:
        return self.rng.choices(self.vocab, cum_weights=self.cum, k=n)

    def sentence(self, n: int) -> str:
        words = self.words(n)
        return " ".join(words).capitalize() + self.rng.choice((".", ".", ".", "?", ";", "!"))

    def title(self) -> str:
        return " ".join(w.capitalize() for w in self.rng.sample(self.vocab[40:800], self.rng.randint(2, 5)))


def _body(prose: _Prose, n_words: int, ids: list[str]) -> str:
    rng, parts, written = prose.rng, [], 0
    while written < n_words:
        if parts and rng.random() < 0.2:
            parts.append("## " + prose.title())
        sentences = []
        for _ in range(rng.randint(2, 6)):
            n = min(rng.randint(6, 22), max(1, n_words - written))
            sentence = prose.sentence(n)
            if ids and rng.random() < 0.12:
                target = rng.choice(ids)
                link = f"[[{target}]]" if rng.random() < 0.7 else f"[[{target}|{' '.join(prose.words(2))}]]"
                sentence = f"{sentence[:-1]} ({link}){sentence[-1]}"
            sentences.append(sentence)
            written += n
            if written >= n_words:
                break
        parts.append(" ".join(sentences))
        if written < n_words and rng.random() < 0.15:
            items = [rng.randint(3, 9) for _ in range(rng.randint(2, 5))]
            parts.append("\n".join(f"- {prose.sentence(n)}" for n in items))
            written += sum(items)
    return "\n\n".join(parts) + "\n"


def _generated_fields(prose: _Prose, folder: str, entry_type: str | None) -> dict[str, Any]:
    rng = prose.rng
    fields: dict[str, Any] = {"type": entry_type} if entry_type else {}
    fields["title"] = prose.title()
    if rng.random() >= 0.04:  # some have no date
        fields["date"] = f"{rng.randint(2018, 2025)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    fields["description"] = prose.sentence(rng.randint(8, 16))
    fields["tags"] = sorted(set(prose.rng.sample(prose.vocab[40:140], rng.randint(1, 4))))
    fields["publish"] = rng.random() >= 0.05  # ~5% unpublished
    if folder.startswith("docs/"):
        fields["group"] = folder.split("/")[1]
    if rng.random() < 0.1:
        fields["author"] = [f"{prose.words(1)[0]}-{prose.words(1)[0]}"]
    return fields


def generated_vault(n_files: int, *, seed: int = 0, words: tuple[int, int] = (150, 600)) -> dict[str, bytes]:
    """``n_files`` realistic markdown notes over the seed's folders and types (deterministic for ``seed``): ~5%
    with an unknown ``type``, ~3% malformed YAML, ~5% unpublished, some without a date, wikilinks between them."""
    rng = random.Random(seed)
    prose = _Prose(rng)
    files: dict[str, bytes] = {}
    ids: list[str] = []
    for i in range(n_files):
        if rng.random() < 0.4:
            folder = f"docs/{rng.choice(_DOC_GROUPS)}" + ("/" + rng.choice(prose.vocab[40:400])) * (rng.random() < 0.3)
            roll = rng.random()
            entry_type: str | None = rng.choice(_UNKNOWN_TYPES) if roll < 0.125 else rng.choice(CONTENT_TYPES)
        else:
            folder, entry_type = rng.choice(_FOLDERS), None
        entry_id = "-".join(prose.words(2) + [f"{i:05d}"])
        fields = _generated_fields(prose, folder, entry_type)
        head = frontmatter(fields)
        if rng.random() < 0.03:  # malformed YAML: an unterminated flow sequence
            head = head.replace("\ntags:", "\nkeywords: [unclosed, list\ntags:", 1)
        body = _body(prose, rng.randint(*words), ids[-500:])
        files[f"{folder}/{entry_id}.md"] = (head + "\n# " + fields["title"] + "\n\n" + body).encode("utf-8")
        ids.append(entry_id)
    return files
