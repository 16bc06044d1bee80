"""Every port is a complete Protocol: each shipped adapter (and each wrapper and test double standing in for one)
implements every member, so services call them directly; ``require`` refuses an object that lacks one."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from services.adapters.cloudflare import (
    CloudflareApi,
    D1Database,
    VectorizeIndex,
    WorkersAIChat,
    WorkersAIEmbedder,
    WorkersAIReranker,
)
from services.adapters.hash_embedder import HashEmbedder
from services.adapters.llm import OpenAICompatibleLLM, WorkersAILLM, WorkersAIRerankerPort
from services.adapters.local_vectors import LocalVectorIndex
from services.adapters.onnx_embedder import OnnxMiniLMEmbedder
from services.adapters.sqlite import SqliteDatabase
from services.conversations.search import ConversationHydrator
from services.errors import InvalidInput
from services.enrichment.llm_budget import BudgetedLLM, LLMBudget
from services.ports import LLM, Embedder, Reranker, SqlDatabase, Vector, VectorIndex, missing_members, require
from services.storage.scoped import OrgSql
from services.search.search import Hydrator
from services.thoughts.hydrator import ThoughtHydrator, hydrate_thoughts
from services.storage.pool import HandlePool, PooledDatabase, PooledIndex
from tests.decision_doubles import ScriptedEmbedder, ScriptedLLM


@pytest.fixture
async def api():
    """A CloudflareApi that never reaches a network: constructing the adapters sends nothing."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"unexpected request {request.method} {request.url}")

    http = httpx.AsyncClient(transport=httpx.MockTransport(refuse))
    yield CloudflareApi(http, account_id="acc", api_token="tok", base_url="https://cf.test/client/v4")
    await http.aclose()


@pytest.fixture
async def adapters(tmp_path, api):
    """(name, adapter, port) for every shipped adapter, wrapper and test double."""
    pool = HandlePool(4)
    db = SqliteDatabase(tmp_path / "db.sqlite3", readers=1)
    local = LocalVectorIndex(tmp_path / "vectors.sqlite3", dimensions=8, model="m")
    hash_emb = HashEmbedder(dimensions=8)
    pooled_db = PooledDatabase(pool, lambda: SqliteDatabase(tmp_path / "pooled.sqlite3", readers=1))
    pooled_index = PooledIndex(pool, lambda: LocalVectorIndex(tmp_path / "pooled-vectors.sqlite3", dimensions=8,
                                                              model="m"), 8)
    chat_llm = WorkersAILLM(WorkersAIChat(api))
    openai_llm = OpenAICompatibleLLM("http://127.0.0.1:9/v1", "some-model")
    items = [
        ("SqliteDatabase", db, SqlDatabase),
        ("D1Database", D1Database(api, "db-uuid"), SqlDatabase),
        ("PooledDatabase", pooled_db, SqlDatabase),
        ("LocalVectorIndex", local, VectorIndex),
        ("LocalVectorIndex in memory", LocalVectorIndex(None, dimensions=8, model="m"), VectorIndex),
        ("VectorizeIndex", VectorizeIndex(api, "idx", dimensions=8, model="m"), VectorIndex),
        ("PooledIndex", pooled_index, VectorIndex),
        ("HashEmbedder", hash_emb, Embedder),
        ("OnnxMiniLMEmbedder", OnnxMiniLMEmbedder(), Embedder),
        ("WorkersAIEmbedder", WorkersAIEmbedder(api), Embedder),
        ("ScriptedEmbedder (test double)", ScriptedEmbedder(), Embedder),
        ("WorkersAILLM", chat_llm, LLM),
        ("OpenAICompatibleLLM", openai_llm, LLM),
        ("BudgetedLLM", BudgetedLLM(chat_llm, OrgSql(db, "org_a"), LLMBudget()), LLM),
        ("ScriptedLLM (test double)", ScriptedLLM(), LLM),
        ("WorkersAIRerankerPort", WorkersAIRerankerPort(WorkersAIReranker(api)), Reranker),
        ("ThoughtHydrator", hydrate_thoughts, Hydrator),
        ("ConversationHydrator", ConversationHydrator(), Hydrator),
    ]
    yield items
    await openai_llm.aclose()
    for closable in (pooled_db, pooled_index, local, db):
        await closable.close()


async def test_every_adapter_implements_its_whole_port(adapters):
    for name, adapter, port in adapters:
        assert missing_members(adapter, port) == [], name
        assert isinstance(adapter, port), name
        assert require(adapter, port, name) is adapter


async def test_synchronous_and_remote_backends_answer_the_members_they_have_nothing_for(adapters, tmp_path):
    by_name = {name: adapter for name, adapter, _ in adapters}
    local, vectorize = by_name["LocalVectorIndex"], by_name["VectorizeIndex"]
    assert local.applies_writes_later is False and vectorize.applies_writes_later is True
    mid = await local.upsert([Vector("a", np.ones(8, dtype=np.float32), "ns")])
    assert await local.searchable(mid) and await local.searchable(mid, issued_at=0.0)
    assert await local.ids_in_namespace("ns") == {"a"}
    assert await local.checkpoint() is None and local.free_bytes() > 0
    memory = by_name["LocalVectorIndex in memory"]
    assert await memory.checkpoint() is None and memory.free_bytes() is None
    # Vectorize cannot list a namespace, and has no log or disk here (no request is sent for any of these)
    assert await vectorize.ids_in_namespace("ns") is None
    assert await vectorize.checkpoint() is None and vectorize.free_bytes() is None
    assert await vectorize.searchable(None)
    d1 = by_name["D1Database"]
    assert await d1.checkpoint() is None and d1.free_bytes() is None
    db = by_name["SqliteDatabase"]
    assert await db.checkpoint() is None and db.free_bytes() > 0
    for model in ("WorkersAILLM", "OpenAICompatibleLLM", "BudgetedLLM", "WorkersAIRerankerPort"):
        assert await by_name[model].aclose() is None, model


async def test_embedders_embed_a_query_as_one_unit_vector(adapters):
    for name, emb, port in adapters:
        if port is not Embedder or name in ("OnnxMiniLMEmbedder", "WorkersAIEmbedder"):  # a model / the network
            continue
        q = await emb.embed_query("where is the lighthouse")
        assert q.shape == (emb.dimensions,) and q.dtype == np.float32, name
        assert np.allclose(q, (await emb.embed(["where is the lighthouse"]))[0]), name
        assert emb.relevance_floor is None or 0 < emb.relevance_floor < 1, name


async def test_a_closed_pooled_handle_is_not_opened_to_checkpoint_or_measure(adapters):
    by_name = {name: adapter for name, adapter, _ in adapters}
    for name in ("PooledDatabase", "PooledIndex"):
        handle = by_name[name]
        assert not handle.is_open
        await handle.checkpoint()
        assert handle.free_bytes() is None and not handle.is_open, name
    index = by_name["PooledIndex"]
    assert index.applies_writes_later is False
    assert await index.searchable("1") and index.is_open  # a real call opens it
    await index.checkpoint()
    assert index.free_bytes() > 0


def test_hydrators_say_what_they_stand_for():
    assert (hydrate_thoughts.chunk_kinds, hydrate_thoughts.collapse_per_parent, hydrate_thoughts.depth) == (
        ("thought",), True, 0)
    assert isinstance(hydrate_thoughts, ThoughtHydrator)
    conv = ConversationHydrator()
    assert (conv.chunk_kinds, conv.collapse_per_parent) == (("conversation", "turn"), False) and conv.depth > 0


class HalfEmbedder:
    """An embedder written against the old, narrower port: no query mode, no relevance floor."""

    model_id, dimensions, max_tokens = "half", 8, 64

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    async def embed(self, texts):
        return np.ones((len(texts), 8), dtype=np.float32) / np.sqrt(8)


def test_require_refuses_an_object_missing_a_member_and_names_them():
    assert missing_members(HalfEmbedder(), Embedder) == ["embed_query", "relevance_floor"]
    with pytest.raises(InvalidInput) as err:
        require(HalfEmbedder(), Embedder, "HalfEmbedder")
    assert "HalfEmbedder does not implement the Embedder port: missing embed_query, relevance_floor" in str(err.value)
    assert err.value.details == {"adapter": "HalfEmbedder", "port": "Embedder",
                                 "missing": ["embed_query", "relevance_floor"]}


# -- the composition root ----------------------------------------------------------------------------------

def test_the_wiring_refuses_an_adapter_missing_a_member(monkeypatch, tmp_path):
    from api.composition import backend
    from api.settings import Settings, SettingsError

    monkeypatch.setattr(backend, "embedder_for", lambda settings, http: HalfEmbedder())
    with pytest.raises(SettingsError) as err:
        backend.build_backend(Settings(data_dir=tmp_path, embedder="hash"))
    assert str(err.value) == ("HalfEmbedder (MEMEX_EMBEDDER=hash) does not implement the Embedder port: "
                              "missing embed_query, relevance_floor")
    assert err.value.details["missing"] == ["embed_query", "relevance_floor"]


def test_the_wiring_refuses_a_reranker_without_aclose(monkeypatch, tmp_path):
    from api.composition import backend
    from api.settings import Settings, SettingsError

    class OldReranker:  # a plug-in reranker written before the port had aclose
        model_id = "old"

        async def rerank(self, query, passages):
            return [0.0] * len(passages)

    monkeypatch.setattr(backend, "reranker_for", lambda settings, http: OldReranker())
    with pytest.raises(SettingsError, match=r"OldReranker \(MEMEX_RERANKER=none\) does not implement the Reranker "
                                            r"port: missing aclose"):
        backend.build_backend(Settings(data_dir=tmp_path, embedder="hash"))


async def test_the_wiring_checks_what_it_builds(tmp_path):
    from api.settings import Settings
    from api.composition.backend import build_backend

    backend = build_backend(Settings(data_dir=tmp_path, embedder="hash"))
    try:
        assert isinstance(backend.control, SqlDatabase) and isinstance(backend.embedder, Embedder)
        db = backend.stores.open_database(tmp_path / "orgs" / "x" / "memex.sqlite3")
        index = backend.stores.open_index(tmp_path / "orgs" / "x" / "vectors.sqlite3")
        assert isinstance(db, SqlDatabase) and isinstance(index, VectorIndex)
        await db.close()
        await index.close()
    finally:
        await backend.close()


def test_a_backend_error_answers_5xx_whatever_the_upstream_status():
    """An adapter error carries the upstream's status (a Cloudflare 404, or None when the connection failed);
    the client gets the service's 503, never the upstream's 404 nor a crash."""
    from api.errors import answer_status
    from services.adapters.cloudflare.client import CloudflareApiError
    from services.errors import BackendError, InsufficientStorage, NotFound

    assert answer_status(CloudflareApiError("d1 call failed", status=404)) == BackendError.status
    assert answer_status(CloudflareApiError("connection failed", status=None)) == BackendError.status
    assert answer_status(InsufficientStorage("full")) == 507
    assert answer_status(NotFound("gone")) == 404
