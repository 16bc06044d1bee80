"""A tantivy index of an organization's thoughts beside its SQLite database (embedded only): the keyword side's
BM25 over whole documents, with block-max WAND top-k, for organizations large enough that FTS5's scoring of every
matched row is most of a search (bench/README.md: at 53,000 documents, 0.4 ms against 8.5-31 ms a query).

SQLite stays the truth and FTS5 stays the fallback. Migration 0004's triggers append every document whose text
changed (captured, content edited, deleted) to ``keyword_changes``, in order. The index answers a search only when
it has applied the log's last entry (``search``: one cheap statement compares them); otherwise it returns None, the
caller ranks with FTS5 as before, and a background thread catches the index up. So a capture is keyword-searchable
as soon as it is acknowledged, whatever the index's state.

On disk, ``<database>.keywords/``: index generations (``gen-<n>/``) and ``state.json``, which names the current
generation, the log position (seq, and the document at that seq) it has applied, and the index's ``LAYOUT``. The
position is written after the index's commit, atomically; a crash between them replays entries, and replaying is
idempotent (each changed document is deleted from the index and added again from its current row). A missing or
damaged state, an index of an older layout or one that does not open, a log that no longer reaches back to the
position, or a position the log does not hold (another database in its place) means a rebuild into a new generation
from ``documents``; the old one is removed after the switch. Organizations below ``build_from`` documents are not
indexed (FTS5 is fast there).

``ChunkKeywordIndex`` is the same machinery over a large organization's conversation chunks (migration 0005's
``chunk_keyword_changes``, ``<database>.chunk-keywords/``): conversation search's keyword side, chunks_fts answering
whenever it is behind, and for a search within one conversation or a time window (filters chunks_fts applies in
its statement).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tantivy

__all__ = ["KeywordIndex", "ChunkKeywordIndex", "BUILD_FROM", "CHUNK_KINDS", "HEAD_SQL", "index_is_current"]

log = logging.getLogger("memex.keywords")

#: Organizations with at least this many documents (the documents_fts key's high-water mark) get an index.
BUILD_FROM = 10_000
#: Seconds an organization found below ``BUILD_FROM`` goes without the look (one statement) before a search.
SMALL_TTL = 60.0
#: Seconds between a failed catch-up and the next attempt.
RETRY_AFTER = 10.0
#: Log entries applied per commit while catching up (bounds the memory of one round).
ROUND = 20_000
#: The writer's memory budget (tantivy's minimum per thread is 15 MB); the writer lives only while it writes.
WRITER_HEAP = 32_000_000
#: The index's fields (``_schema``), saved in ``state.json``: an index of another layout is rebuilt, not read.
#: 2: the ``hi``/``lo`` id columns.
LAYOUT = 2
#: A document id ``_document`` also writes as the ``hi``/``lo`` columns (``services.ids.new_id``'s form).
_HEX_ID = re.compile(r"[0-9a-f]{32}")


def _head_sql(log_table: str, key: str, size_sql: str) -> str:
    """The log's position and the source's size, one statement before each search."""
    return (f"SELECT (SELECT max(seq) FROM {log_table}) AS seq, "
            f"(SELECT {key} FROM {log_table} ORDER BY seq DESC LIMIT 1) AS last, ({size_sql}) AS size")


def index_is_current(db_path: str | Path, kind: type[KeywordIndex] | None = None) -> bool | None:
    """Whether the keyword index of ``kind`` (``KeywordIndex``, the thoughts', by default; or ``ChunkKeywordIndex``)
    beside the database at ``db_path`` has applied its log's last entry, read from the files (another process's view:
    benchmarks, tests over HTTP); None when it has none."""
    kind = kind or KeywordIndex
    state_path = Path(str(db_path) + kind.SUFFIX) / "state.json"
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError):
        return None
    conn = sqlite3.connect(Path(db_path).resolve().as_uri() + "?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        head = conn.execute(kind.HEAD_SQL).fetchone()
    finally:
        conn.close()
    return state.get("layout") == kind.LAYOUT and (state.get("seq"), state.get("last")) == _position(head)


def _position(head: Any) -> tuple[int, str | int | None]:
    """The log's last entry (a ``HEAD_SQL`` row) as an index position: (seq, its document); (0, None) when empty."""
    return head["seq"] or 0, head["last"]


#: The content's analyzer, as close to documents_fts's ``porter unicode61`` as tantivy's filters go: words of
#: letters and digits, lowercased, diacritics folded ("café" finds "cafe"), English stems.
ANALYZER = "memex_en"


def _analyzer() -> Any:
    return (tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple()).filter(tantivy.Filter.remove_long(40))
            .filter(tantivy.Filter.lowercase()).filter(tantivy.Filter.ascii_fold())
            .filter(tantivy.Filter.stemmer("english")).build())


def _registered(index: Any) -> Any:
    """``index`` with the analyzer its content field names (tantivy keeps only built-in analyzers on disk)."""
    index.register_tokenizer(ANALYZER, _analyzer())
    return index


def _document(org: str, doc: str, content: str) -> Any:
    d = tantivy.Document(key=f"{org}/{doc}", org=org, id=doc, content=content)
    if _HEX_ID.fullmatch(doc):
        d.add_unsigned("hi", int(doc[:16], 16))
        d.add_unsigned("lo", int(doc[16:], 16))
    return d


def _ids(searcher: Any, hits: list[tuple[float, Any]]) -> list[tuple[str, float]]:
    """The hits' document ids: two reads of the ``hi``/``lo`` columns for all of them, the stored ``id`` only for
    an id that is not 32 hex digits (an imported one). ``searcher.doc`` lets go of the GIL and takes it back: one
    per hit was 100 hand-overs a search, ~1 us each alone and ~1 ms each while another thread runs Python (a server
    under load). The column reads keep the GIL: 0.065 ms for 100 hits either way (bench/README.md)."""
    addrs = [addr for _, addr in hits]
    his, los = searcher.fast_field_values("hi", addrs), searcher.fast_field_values("lo", addrs)
    return [(f"{hi:016x}{lo:016x}" if hi is not None and lo is not None else searcher.doc(addr)["id"][0], float(score))
            for (score, addr), hi, lo in zip(hits, his, los, strict=True)]


def _schema() -> Any:
    sb = tantivy.SchemaBuilder()
    sb.add_text_field("key", stored=False, tokenizer_name="raw", index_option="basic")  # organization "/" document
    sb.add_text_field("org", stored=False, tokenizer_name="raw", index_option="basic")
    sb.add_text_field("id", stored=True, tokenizer_name="raw", index_option="basic")
    sb.add_text_field("content", stored=False, tokenizer_name=ANALYZER)
    # the id again when it is 32 hex digits (``new_id``'s), as two columns a search reads for all its hits at once
    sb.add_unsigned_field("hi", fast=True)
    sb.add_unsigned_field("lo", fast=True)
    return sb.build()


@dataclass(frozen=True, slots=True)
class _Open:
    """One published view: what a search reads together (the searcher and the position it reflects)."""
    index: Any
    searcher: Any
    generation: str
    seq: int
    last: str | int | None

    @property
    def position(self) -> tuple[int, str | int | None]:
        return self.seq, self.last


class KeywordIndex:
    """The index of one organization database (see the module docstring). ``read(sql, params)`` runs a read
    statement on the database's readers; ``connect()`` opens a read-only connection of the catch-up's own.

    The class attributes and the ``_schema`` / ``_entry`` / ``_query`` / ``_hits`` hooks say what is indexed: here
    the thoughts (``documents``, logged in ``keyword_changes``); ``ChunkKeywordIndex`` the conversations' chunks."""

    #: The directory beside the database.
    SUFFIX = ".keywords"
    #: The change log (a table with ``seq``, ``organization_id`` and ``KEY``) that migrations' triggers write.
    LOG = "keyword_changes"
    KEY = "document_id"
    #: The source's size, compared with ``build_from`` before a first build.
    SIZE_SQL = "SELECT max(pk) FROM documents_fts_keys"
    HEAD_SQL = _head_sql(LOG, KEY, SIZE_SQL)
    LAYOUT = LAYOUT
    #: Every row to index: (organization, key, *what ``_entry`` takes).
    SOURCE_SQL = "SELECT organization_id, id, content FROM documents"
    #: The rows of the keys logged in a range of seq (``?``, ``?``) that still exist, in ``SOURCE_SQL``'s columns.
    CHANGED_SQL = (
        "SELECT d.organization_id, d.id, d.content FROM (SELECT DISTINCT organization_id, document_id "
        "FROM keyword_changes WHERE seq > ? AND seq <= ?) AS k CROSS JOIN documents d "
        "ON d.organization_id = k.organization_id AND d.id = k.document_id")

    def __init__(self, db_path: str, read: Callable[[str, tuple], list[dict[str, Any]]],
                 connect: Callable[[], sqlite3.Connection], *, build_from: int = BUILD_FROM) -> None:
        self.root = Path(db_path + self.SUFFIX)
        self.build_from = build_from
        self._read = read
        self._connect = connect
        self._lock = threading.Lock()
        self._open: _Open | None = None
        self._loaded = False
        self._thread: threading.Thread | None = None
        self._closed = False
        #: Until when (monotonic) the organization counts as too small to index, once it was seen to be.
        self._small_until = 0.0
        #: Until when (monotonic) no catch-up starts, after one failed.
        self._retry_at = 0.0

    # -- searching ---------------------------------------------------------------------------------

    def wanted(self) -> bool:
        """Whether ``search`` may answer: False (without a statement) for an organization recently seen below
        ``build_from`` documents; it is looked at again after ``SMALL_TTL`` seconds."""
        return not self._closed and (self._open is not None or time.monotonic() >= self._small_until)

    def search(self, org_id: str, words: list[str], limit: int,
               kinds: list[str] | None = None) -> list[tuple[Any, float]] | None:
        """The ``limit`` best entries for any of ``words`` (BM25, best first) as (key, score), or None when the
        index is not there or behind the log (then a catch-up starts; the caller asks FTS5). Thoughts: (document id,
        score); ``kinds`` is for ``ChunkKeywordIndex``."""
        if self._closed or not words:
            return None
        if not self._loaded:
            self._load()
        view = self._open
        try:
            head = self._read(self.HEAD_SQL, ())[0]
        except sqlite3.Error:  # a database without the log yet (mid-migration): FTS5 answers
            return None
        if view is None:
            if (head["size"] or 0) >= self.build_from:
                self.catch_up()
            else:
                self._small_until = time.monotonic() + SMALL_TTL
            return None
        if view.position != _position(head):
            self.catch_up()
            return None
        try:
            query = self._query(view.index, org_id, words, kinds)
            # count=False: no count of every match, which block-max WAND's top-k would otherwise have to make
            return self._hits(view.searcher, view.searcher.search(query, limit, count=False).hits)
        except (ValueError, OSError):  # a word the parser refuses, a file gone: FTS5 answers
            log.warning("keyword index of %s: search failed; FTS5 answers", self.root, exc_info=True)
            return None

    def _query(self, index: Any, org_id: str, words: list[str], kinds: list[str] | None) -> Any:
        """Any of ``words`` in the content, within the organization (a filter scoring nothing: defence in depth,
        the database is its own alone)."""
        mine = tantivy.Query.const_score_query(tantivy.Query.term_query(index.schema, "org", org_id), 0.0)
        return tantivy.Query.boolean_query(
            [(tantivy.Occur.Must, mine), (tantivy.Occur.Must, tantivy.Query.boolean_query(
                [(tantivy.Occur.Should, index.parse_query(w, ["content"])) for w in words]))])

    @staticmethod
    def _hits(searcher: Any, hits: list[tuple[float, Any]]) -> list[tuple[Any, float]]:
        return _ids(searcher, hits)

    @staticmethod
    def _schema() -> Any:
        return _schema()

    @staticmethod
    def _entry(org: str, key: Any, *rest: Any) -> Any:
        """The index's document for a ``SOURCE_SQL`` row."""
        return _document(org, key, *rest)

    # -- keeping up ----------------------------------------------------------------------------------

    def catch_up(self) -> None:
        """Start the background catch-up (or build) unless one runs, or one failed less than ``RETRY_AFTER``
        seconds ago (another process holding the index's writer, a full disk: FTS5 answers meanwhile)."""
        with self._lock:
            if self._closed or (self._thread is not None and self._thread.is_alive()) or \
                    time.monotonic() < self._retry_at:
                return
            self._thread = threading.Thread(target=self._run, name=f"keywords {self.root.parent.name}", daemon=True)
            self._thread.start()

    def sync(self, timeout: float = 120.0) -> bool:
        """Catch up now and wait (tests, benchmarks, ``memex`` commands): True when the index is current."""
        if not self._loaded:
            self._load()
        self._retry_at = 0.0
        self.catch_up()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        view = self._open
        head = self._read(self.HEAD_SQL, ())[0]
        return view is not None and view.position == _position(head)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            thread.join(30)
        self._open = None

    def _run(self) -> None:
        try:
            conn = self._connect()
        except sqlite3.Error:
            log.warning("keyword index of %s: cannot read the database", self.root, exc_info=True)
            return
        try:
            for _ in range(1000):  # rounds until current (ROUND entries each); bounded against a runaway writer
                if self._closed or self._step(conn):
                    return
        except Exception:  # the index is an accelerator: FTS5 keeps answering; a later search tries again
            self._retry_at = time.monotonic() + RETRY_AFTER
            log.warning("keyword index of %s: catch-up failed; FTS5 answers, retrying in %.0f s", self.root,
                        RETRY_AFTER, exc_info=True)
        finally:
            conn.close()

    def _step(self, conn: sqlite3.Connection) -> bool:
        """One round in one read snapshot: True when the index is current afterwards."""
        self._load()
        conn.execute("BEGIN")
        try:
            head = conn.execute(f"SELECT max(seq), min(seq) FROM {self.LOG}").fetchone()
            top, bottom = head[0] or 0, head[1]
            view = self._open
            if view is None:
                size = conn.execute(self.SIZE_SQL).fetchone()[0] or 0
                if size < self.build_from:
                    return True
                self._rebuild(conn, top)
                return True
            here = conn.execute(f"SELECT {self.KEY} FROM {self.LOG} WHERE seq = ?", (view.seq,)).fetchone()
            reaches = bottom is None or view.seq >= bottom - 1
            same_log = (here[0] if here else None) == view.last if view.seq >= (bottom or 1) else view.last is None
            if view.seq > top or not reaches or not same_log:
                self._rebuild(conn, top)
                return True
            if view.seq == top:
                return True
            upto = min(top, view.seq + ROUND)
            self._apply(conn, view, upto)
            return upto == top
        finally:
            conn.execute("COMMIT")

    def _apply(self, conn: sqlite3.Connection, view: _Open, upto: int) -> None:
        changed = conn.execute(
            f"SELECT DISTINCT organization_id, {self.KEY} FROM {self.LOG} WHERE seq > ? AND seq <= ?",
            (view.seq, upto)).fetchall()
        last = conn.execute(f"SELECT {self.KEY} FROM {self.LOG} WHERE seq = ?", (upto,)).fetchone()[0]
        writer = view.index.writer(heap_size=WRITER_HEAP, num_threads=1)
        try:
            for org, key in changed:  # deletes first: a delete removes what was added before it
                writer.delete_documents_by_term("key", f"{org}/{key}")
            # the changed entries that still exist, streamed (a round's texts may be large)
            for row in conn.execute(self.CHANGED_SQL, (view.seq, upto)):
                writer.add_document(self._entry(*row))
            if self._closed:
                writer.rollback()
                return
            writer.commit()
        finally:
            writer.wait_merging_threads()
        self._switch(view.index, view.generation, upto, last)

    def _rebuild(self, conn: sqlite3.Connection, top: int) -> None:
        last = conn.execute(f"SELECT {self.KEY} FROM {self.LOG} WHERE seq = ?", (top,)).fetchone() if top else None
        generation = f"gen-{time.time_ns()}"
        path = self.root / generation
        path.mkdir(parents=True)
        index = _registered(tantivy.Index(self._schema(), path=str(path)))
        writer = index.writer(heap_size=WRITER_HEAP, num_threads=1)
        try:
            for row in conn.execute(self.SOURCE_SQL):
                if self._closed:
                    writer.rollback()
                    return
                writer.add_document(self._entry(*row))
            writer.commit()
        finally:
            writer.wait_merging_threads()
        self._switch(index, generation, top, last[0] if last else None)
        self._sweep(keep=generation)

    # -- the files -------------------------------------------------------------------------------------

    def _load(self) -> None:
        """Open the generation ``state.json`` names when it is not the one open (first use, or another process
        moved on); a damaged state or index, or one of an older ``LAYOUT``, leaves nothing open (the catch-up
        rebuilds)."""
        with self._lock:
            self._loaded = True
            state_path = self.root / "state.json"
            try:
                state = json.loads(state_path.read_text())
                generation, seq, last = str(state["generation"]), int(state["seq"]), state["last"]
                if last is not None and not isinstance(last, str | int):
                    raise ValueError("last must be a key of the log")
                if not re.fullmatch(r"gen-\d+", generation):  # a name inside root, nothing else
                    raise ValueError(f"not a generation: {generation!r}")
            except FileNotFoundError:
                return
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("keyword index of %s: unreadable state; rebuilding", self.root)
                self._open = None
                return
            if state.get("layout") != self.LAYOUT:
                log.info("keyword index of %s: an older layout; rebuilding", self.root)
                self._open = None
                return
            view = self._open
            if view is not None and view.generation == generation and view.position == (seq, last):
                return
            try:
                if view is not None and view.generation == generation:
                    view.index.reload()
                    index = view.index
                else:
                    index = _registered(tantivy.Index.open(str(self.root / generation)))
                self._open = _Open(index, index.searcher(), generation, seq, last)
            except (ValueError, OSError):
                log.warning("keyword index of %s: %s does not open; rebuilding", self.root, generation)
                self._open = None

    def _save(self, generation: str, seq: int, last: str | int | None) -> None:
        tmp = self.root / "state.json.tmp"
        with open(tmp, "w") as f:
            json.dump({"generation": generation, "seq": seq, "last": last, "layout": self.LAYOUT}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / "state.json")
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _switch(self, index: Any, generation: str, seq: int, last: str | int | None) -> None:
        """After a commit: save the position, then let searches read the committed index at it."""
        self._save(generation, seq, last)
        index.reload()
        with self._lock:
            if not self._closed:
                self._open = _Open(index, index.searcher(), generation, seq, last)

    def _sweep(self, keep: str) -> None:
        for p in self.root.glob("gen-*"):
            if p.name != keep:
                shutil.rmtree(p, ignore_errors=True)


#: The thoughts' index's head statement (``_head_sql``).
HEAD_SQL = KeywordIndex.HEAD_SQL

#: The chunk kinds ``ChunkKeywordIndex`` holds: a conversation's windows and single turns (the conversation
#: hydrator's ``chunk_kinds``). Migration 0005's triggers log these kinds only.
CHUNK_KINDS = ("conversation", "turn")


def _chunk_schema() -> Any:
    sb = tantivy.SchemaBuilder()
    sb.add_text_field("key", stored=False, tokenizer_name="raw", index_option="basic")  # organization "/" chunk pk
    sb.add_text_field("org", stored=False, tokenizer_name="raw", index_option="basic")
    sb.add_text_field("kind", stored=False, tokenizer_name="raw", index_option="basic")
    sb.add_text_field("content", stored=False, tokenizer_name=ANALYZER)
    sb.add_unsigned_field("pk", fast=True)  # the chunk's row: a search reads all its hits' in one call
    return sb.build()


class ChunkKeywordIndex(KeywordIndex):
    """The same machinery over a large organization's conversation chunks (``chunks`` of ``CHUNK_KINDS``, logged by
    migration 0005 in ``chunk_keyword_changes`` by their ``pk``): conversation search's keyword side, which FTS5
    answers from ``chunks_fts`` otherwise (at 134,000 chunks ~13-16 ms a query, scoring every matched row;
    bench/README.md). A hit is (chunk pk, BM25); the caller reads the chunks' rows by pk. Chunks are written and
    deleted, never edited (their text is what was embedded), so the log has no update trigger."""

    SUFFIX = ".chunk-keywords"
    LOG = "chunk_keyword_changes"
    KEY = "chunk_pk"
    #: Every chunk's row (thoughts' too: a bound read in one index seek, where a count of the conversation chunks
    #: would read them all); an organization past it with few conversation chunks gets a small index.
    SIZE_SQL = "SELECT max(pk) FROM chunks"
    HEAD_SQL = _head_sql(LOG, KEY, SIZE_SQL)
    LAYOUT = 1
    SOURCE_SQL = f"SELECT organization_id, pk, kind, content FROM chunks WHERE kind IN {CHUNK_KINDS!r}"
    CHANGED_SQL = (
        "SELECT c.organization_id, c.pk, c.kind, c.content FROM (SELECT DISTINCT chunk_pk FROM chunk_keyword_changes "
        f"WHERE seq > ? AND seq <= ?) AS k CROSS JOIN chunks c ON c.pk = k.chunk_pk WHERE c.kind IN {CHUNK_KINDS!r}")

    def _query(self, index: Any, org_id: str, words: list[str], kinds: list[str] | None) -> Any:
        query = super()._query(index, org_id, words, kinds)
        if not kinds:
            return query
        kind = tantivy.Query.const_score_query(tantivy.Query.boolean_query(
            [(tantivy.Occur.Should, tantivy.Query.term_query(index.schema, "kind", k)) for k in kinds]), 0.0)
        return tantivy.Query.boolean_query([(tantivy.Occur.Must, kind), (tantivy.Occur.Must, query)])

    @staticmethod
    def _hits(searcher: Any, hits: list[tuple[float, Any]]) -> list[tuple[Any, float]]:
        pks = searcher.fast_field_values("pk", [addr for _, addr in hits])
        return [(pk, float(score)) for (score, _), pk in zip(hits, pks, strict=True)]

    @staticmethod
    def _schema() -> Any:
        return _chunk_schema()

    @staticmethod
    def _entry(org: str, key: Any, *rest: Any) -> Any:
        kind, content = rest
        d = tantivy.Document(key=f"{org}/{key}", org=org, kind=kind, content=content)
        d.add_unsigned("pk", key)
        return d
