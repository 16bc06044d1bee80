"""D1 database administration (one database per organization): the ``D1Admin`` adapter against the Cloudflare
emulator over loopback HTTP, and the emulator's admin endpoints on the wire."""

from __future__ import annotations

import uuid as uuidlib

import httpx
import pytest

from api.composition.cloudflare import cloudflare_stats, d1_admin, shared_client
from api.settings import Settings
from services.adapters.cloudflare import CloudflareApiError, CloudflareNotFound, D1AccountLimit, D1Admin
from services.errors import InsufficientStorage, InvalidInput
from tests.cloudflare_emulator import running_emulator

CONTROL = "memex-control-db"


@pytest.fixture(scope="module")
def emu():
    # a preset control database; every other id exists only once created through the API
    with running_emulator(databases=[CONTROL], rate_limit=1_000_000) as e:
        yield e


@pytest.fixture()
def cf(emu):
    emu.clear_faults()
    emu.d1_max_databases = 50_000
    yield emu
    emu.clear_faults()
    emu.d1_max_databases = 50_000


def _settings(emu) -> Settings:
    return Settings(cloudflare_account_id=emu.account, cloudflare_api_token=emu.token,
                    cloudflare_d1_database_id=CONTROL, cloudflare_api_base_url=emu.base_url,
                    cloudflare_budget_limit=1_000_000)


@pytest.fixture()
async def admin(cf):
    s = _settings(cf)
    http = shared_client(s)
    a = d1_admin(s, http)
    a.api.backoff_base = 0.01  # retries in these tests wait milliseconds, not seconds
    yield a
    await http.aclose()


def _name(prefix: str = "org") -> str:
    return f"{prefix}-{uuidlib.uuid4().hex[:12]}"


def _ok(r: httpx.Response):
    body = r.json()
    assert r.status_code < 300 and body["success"] is True, r.text
    return body


def _fail(r: httpx.Response, status: int) -> dict:
    body = r.json()
    assert r.status_code == status and body["success"] is False and body["result"] is None, r.text
    return body["errors"][0]


# --------------------------------------------------------------------------------------------------------
# The adapter
# --------------------------------------------------------------------------------------------------------

async def test_create_query_list_delete(admin, cf):
    name = _name()
    uid = await admin.create_database(name)
    assert str(uuidlib.UUID(uid)) == uid
    db = admin.database(uid)
    await db.executescript("CREATE TABLE notes(id TEXT PRIMARY KEY, body TEXT)")
    await db.execute("INSERT INTO notes VALUES (?1, ?2)", ["n1", "hello"])
    assert (await db.execute("SELECT body FROM notes")).rows == [{"body": "hello"}]

    listed = {d["uuid"]: d for d in await admin.list_databases()}
    assert listed[uid]["name"] == name and listed[uid]["version"] == "production" and CONTROL in listed
    assert await admin.find_database(name) == uid

    await admin.delete_database(uid)
    with pytest.raises(CloudflareNotFound):
        await db.execute("SELECT 1")
    assert await admin.find_database(name) is None
    assert uid not in [d["uuid"] for d in await admin.list_databases()]


async def test_databases_are_isolated(admin):
    a, b = await admin.create_database(_name("iso-a")), await admin.create_database(_name("iso-b"))
    assert a != b
    await admin.database(a).executescript("CREATE TABLE only_in_a(x); INSERT INTO only_in_a VALUES (1)")
    tables = "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'only_in_a'"
    assert (await admin.database(a).execute(tables)).rows == [{"name": "only_in_a"}]
    assert (await admin.database(b).execute(tables)).rows == []
    with pytest.raises(Exception, match="no such table"):
        await admin.database(b).execute("SELECT x FROM only_in_a")
    for uid in (a, b):
        await admin.delete_database(uid)


async def test_account_limit_is_d1_account_limit(admin, cf):
    cf.d1_max_databases = cf.d1.count(cf.account) + 1
    last = await admin.create_database(_name("fill"))
    with pytest.raises(D1AccountLimit) as info:
        await admin.create_database(_name("one-too-many"))
    err = info.value
    assert isinstance(err, CloudflareApiError) and isinstance(err, InsufficientStorage)
    assert (err.status, err.code, err.cloudflare_status) == (507, "insufficient_storage", 400)
    assert err.codes == [7406] and err.limit == cf.d1_max_databases and err.attempts == 1
    assert "limit of D1 databases" in err.message
    await admin.delete_database(last)  # room again
    await admin.delete_database(await admin.create_database(_name("fits")))


async def test_create_again_after_duplicate_returns_the_same_uuid(admin, cf):
    name = _name("dup")
    first = await admin.create_database(name)
    cf.reset_counters()
    assert await admin.create_database(name) == first  # 7502, then looked up by name
    ops = cf.counters_snapshot()["by_op"]
    assert ops == {"d1.create": 1, "d1.list": 1}
    assert [d["uuid"] for d in await admin.list_databases() if d["name"] == name] == [first]
    await admin.delete_database(first)


async def test_a_create_whose_answer_was_lost_is_retried_into_the_same_database(admin, cf):
    name = _name("lost")
    # the create runs, then the answer is a 500: the client retries, gets 7502 and resolves the name
    cf.fail_next(1, status=500, path_contains="/d1/database", method="POST", after=True)
    uid = await admin.create_database(name)
    assert [d["uuid"] for d in await admin.list_databases() if d["name"] == name] == [uid]
    assert cloudflare_stats(admin.api.http)["retries"]["d1"] >= 1
    # same, but the retry meets a full account (the API's order of checks is not documented): still the uuid
    name2 = _name("lost-full")
    cf.fail_next(1, status=500, path_contains="/d1/database", method="POST", after=True)
    cf.inject_fault("status", 1, status=400, code=7406, path_contains="/d1/database", method="POST",
                    message="System limit reached: databases per account (3)")
    uid2 = await admin.create_database(name2)
    assert await admin.find_database(name2) == uid2
    for u in (uid, uid2):
        await admin.delete_database(u)


async def test_delete_is_idempotent_and_spares_the_control_database(admin, cf):
    uid = await admin.create_database(_name("twice"))
    await admin.delete_database(uid)
    await admin.delete_database(uid)  # already gone: fine
    await admin.delete_database(str(uuidlib.uuid4()))  # never existed: fine too
    # the delete ran but its answer was lost: the retry's 7404 means done
    uid = await admin.create_database(_name("lost-delete"))
    cf.fail_next(1, status=502, path_contains=f"/d1/database/{uid}", method="DELETE", after=True)
    await admin.delete_database(uid)
    assert cf.d1.count(cf.account) == len(await admin.list_databases())
    with pytest.raises(InvalidInput):
        await admin.delete_database(CONTROL)
    with pytest.raises(InvalidInput):
        await admin.delete_database("../etc")
    # a 404 that is not D1's "no such database" (wrong base URL, say) is not taken for "already deleted"
    cf.fail_next(1, status=404, code=7000, message="No route for that URI", method="DELETE")
    with pytest.raises(CloudflareNotFound):
        await admin.delete_database(str(uuidlib.uuid4()))


async def test_listing_follows_pages_and_filters_by_prefix(cf):
    s = _settings(cf)
    http = shared_client(s)
    try:
        small = D1Admin(d1_admin(s, http).api, page_size=10)
        prefix = _name("page") + "-"
        made = [await small.create_database(f"{prefix}{i:02d}") for i in range(23)]
        cf.reset_counters()
        got = await small.list_databases(prefix)
        assert [d["uuid"] for d in got] == made  # oldest first, across 3 pages of 10
        total = len(await small.list_databases())
        assert cf.counters_snapshot()["by_op"]["d1.list"] == 2 * max(1, -(-total // 10))  # ceil: result_info ends it
        assert await small.find_database(f"{prefix}07") == made[7]
        assert await small.find_database(prefix) is None  # no exact match, however the server searches
        for uid in made:
            await small.delete_database(uid)
        assert await small.list_databases(prefix) == []
    finally:
        await http.aclose()


async def test_bad_names_are_refused_before_any_request(admin, cf):
    cf.reset_counters()
    for bad in ("", "  ", " padded", None):
        with pytest.raises(InvalidInput):
            await admin.create_database(bad)
    assert cf.counters_snapshot()["total"] == 0


# --------------------------------------------------------------------------------------------------------
# The emulator on the wire
# --------------------------------------------------------------------------------------------------------

def test_wire_create_get_list_and_errors(cf):
    with httpx.Client(base_url=cf.account_url, headers=cf.headers, timeout=10) as c:
        name = _name("wire")
        r = c.post("/d1/database", json={"name": name, "primary_location_hint": "enam"})
        res = _ok(r)["result"]
        assert set(res) >= {"uuid", "name", "created_at", "version", "num_tables", "file_size"}
        assert res["name"] == name and res["version"] == "production" and res["created_in_region"] == "ENAM"
        assert _ok(c.get(f"/d1/database/{res['uuid']}"))["result"]["uuid"] == res["uuid"]

        assert _fail(c.post("/d1/database", json={"name": name}), 400)["code"] == 7502
        assert _fail(c.post("/d1/database", json={}), 400)["code"] == 7400
        assert _fail(c.post("/d1/database", json={"name": _name(), "primary_location_hint": "mars"}), 400)

        body = _ok(c.get("/d1/database", params={"name": name[4:], "per_page": 10}))
        assert [d["uuid"] for d in body["result"]] == [res["uuid"]]
        assert set(body["result"][0]) == {"uuid", "name", "created_at", "version", "jurisdiction"}
        assert body["result_info"] == {"page": 1, "per_page": 10, "count": 1, "total_count": 1}
        for bad in ({"per_page": 9}, {"per_page": 10_001}, {"page": 0}, {"page": "x"}):
            _fail(c.get("/d1/database", params=bad), 400)

        never = str(uuidlib.uuid4())
        for path in (f"/d1/database/{never}/query", f"/d1/database/{never}/raw"):
            assert _fail(c.post(path, json={"sql": "SELECT 1"}), 404)["code"] == 7404
        assert _fail(c.post("/d1/database/some-name/query", json={"sql": "SELECT 1"}), 404)["code"] == 7404
        assert _fail(c.delete(f"/d1/database/{never}"), 404)["code"] == 7404
        _ok(c.post(f"/d1/database/{CONTROL}/query", json={"sql": "SELECT 1"}))  # the preset one exists

        _ok(c.delete(f"/d1/database/{res['uuid']}"))
        assert _fail(c.post(f"/d1/database/{res['uuid']}/raw", json={"sql": "SELECT 1"}), 404)["code"] == 7404
        assert _fail(c.get(f"/d1/database/{res['uuid']}"), 404)["code"] == 7404
        _ok(c.post("/d1/database", json={"name": name}))  # the name is free again


def test_wire_account_limit_through_the_admin_config(cf):
    with httpx.Client(base_url=cf.account_url, headers=cf.headers, timeout=10) as c, \
            httpx.Client(base_url=cf.admin_url, timeout=10) as admin:
        n = cf.d1.count(cf.account)
        cfg = admin.post("/config", json={"d1_max_databases": n}).json()
        assert cfg["d1_max_databases"] == n and cf.d1_max_databases == n
        assert admin.get("/config").json()["d1_auto_create"] is False
        err = _fail(c.post("/d1/database", json={"name": _name("full")}), 400)
        assert err == {"code": 7406, "message": f"System limit reached: databases per account ({n})"}
        assert admin.post("/config", json={"d1_max_databases": -1}).status_code == 400
        assert admin.post("/config", json={"d1_auto_create": "yes"}).status_code == 400
        admin.post("/config", json={"d1_max_databases": n + 1})
        uid = _ok(c.post("/d1/database", json={"name": _name("room")}))["result"]["uuid"]
        _ok(c.delete(f"/d1/database/{uid}"))


def test_admin_calls_are_counted_and_rate_limited(cf):
    cf.reset_counters()
    with httpx.Client(base_url=cf.account_url, headers=cf.headers, timeout=10) as c:
        uid = _ok(c.post("/d1/database", json={"name": _name("count")}))["result"]["uuid"]
        _ok(c.get("/d1/database"))
        _ok(c.get(f"/d1/database/{uid}"))
        _ok(c.delete(f"/d1/database/{uid}"))
        snap = cf.counters_snapshot()
        assert snap["d1"] == 4 and {k: snap["by_op"][k] for k in ("d1.create", "d1.list", "d1.get", "d1.delete")} \
            == {"d1.create": 1, "d1.list": 1, "d1.get": 1, "d1.delete": 1}
        try:
            cf.set_rate_limit(2, 60)
            _ok(c.get("/d1/database"))
            _ok(c.get("/d1/database"))
            assert c.post("/d1/database", json={"name": _name("blocked")}).status_code == 429
        finally:
            cf.set_rate_limit(1_000_000, 300)


def test_default_mode_auto_creates_named_ids_only_and_deletes_remove_files(tmp_path):
    with running_emulator(data_dir=tmp_path / "cf") as e, \
            httpx.Client(base_url=e.account_url, headers=e.headers, timeout=10) as c:
        assert e.config()["d1_auto_create"] is True and e.config()["d1_max_databases"] == 50_000
        _ok(c.post("/d1/database/named-control/query", json={"sql": "CREATE TABLE t(x)"}))  # as before
        never = str(uuidlib.uuid4())
        assert _fail(c.post(f"/d1/database/{never}/query", json={"sql": "SELECT 1"}), 404)["code"] == 7404
        uid = _ok(c.post("/d1/database", json={"name": "org-1"}))["result"]["uuid"]
        _ok(c.post(f"/d1/database/{uid}/query", json={"sql": "CREATE TABLE t(x)"}))
        files = tmp_path / "cf" / "d1" / e.account
        assert (files / f"{uid}.sqlite3").exists() and (files / "named-control.sqlite3").exists()
        _ok(c.delete(f"/d1/database/{uid}"))
        _ok(c.delete("/d1/database/named-control"))
        assert not (files / f"{uid}.sqlite3").exists() and not (files / "named-control.sqlite3").exists()
        # deleted stays deleted, even for an id auto-creation would otherwise bring back
        assert _fail(c.post("/d1/database/named-control/query", json={"sql": "SELECT 1"}), 404)["code"] == 7404
        keep = _ok(c.post("/d1/database", json={"name": "org-2"}))["result"]["uuid"]
        _ok(c.post(f"/d1/database/{keep}/query", json={"sql": "CREATE TABLE kept(x); INSERT INTO kept VALUES (5)"}))
    with running_emulator(data_dir=tmp_path / "cf") as e, \
            httpx.Client(base_url=e.account_url, headers=e.headers, timeout=10) as c:
        rows = _ok(c.post(f"/d1/database/{keep}/query", json={"sql": "SELECT x FROM kept"}))["result"][0]["results"]
        assert rows == [{"x": 5}]
        assert [d["name"] for d in _ok(c.get("/d1/database"))["result"]] == ["org-2"]
        assert _fail(c.post(f"/d1/database/{uid}/query", json={"sql": "SELECT 1"}), 404)["code"] == 7404
        assert _fail(c.post("/d1/database", json={"name": "org-2"}), 400)["code"] == 7502
