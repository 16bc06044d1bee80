"""The keyword index's upkeep on a kept ``bench_search_scale.py`` set (services/adapters/keyword_index.py): how long a
build from the documents takes, and how long the index stays behind (FTS5 answering meanwhile) after a burst of
captures. In process, on the set's own organization, with the hash embedder it was loaded with::

    .venv/bin/python bench/bench_keyword_index.py --data-dir DIR     # DIR: bench_search_scale.py --keep

1. **build**: the index directory is removed (it is derived data) and ``keyword_sync`` rebuilds it;
2. **catch-up**: 1, 100 and 1,000 captures (through the thoughts service, as the API captures), then
   ``keyword_sync``: the time until the index answers again. The captures are deleted afterwards (their deletes are
   applied too, and timed), so the set holds what it held before.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_foundation import NoteGenerator, log, stored_org  # noqa: E402


async def run(data_dir: Path, bursts: list[int]) -> dict:
    for path in (data_dir / "orgs").glob("*/memex.sqlite3.keywords"):  # derived data: rebuilt below
        shutil.rmtree(path)
    out: dict = {"bench": "keyword_index"}
    async with stored_org(data_dir) as (memex, org, svc):
        db = (await memex.stores.open(org["id"])).db
        path = memex.stores.directory(org["id"]) / "memex.sqlite3.keywords"
        t0 = time.perf_counter()
        assert await db.keyword_sync(timeout=600)
        out["build_s"] = round(time.perf_counter() - t0, 2)
        out["disk_mb"] = round(sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6, 1)
        documents = (await db.execute("SELECT COUNT(*) AS n FROM documents")).rows[0]["n"]
        out["documents"] = documents
        log(f"built over {documents:,} documents in {out['build_s']} s, {out['disk_mb']} MB")
        gen = NoteGenerator(seed=4321)
        for n in bursts:
            ids = []
            for i in range(n):
                title, body = gen.note(10_000_000 + n * 10 + i)
                ids.append((await svc.thoughts.capture(f"# {title}\n\n{body}", source="bench-keyword-index")).id)
            behind = await db.keyword_search(org["id"], ["note"], 10) is None
            t0 = time.perf_counter()
            assert await db.keyword_sync()
            caught = time.perf_counter() - t0
            for doc in ids:
                await svc.thoughts.delete(doc)
            t0 = time.perf_counter()
            assert await db.keyword_sync()
            out[f"captures_{n}"] = {"behind_after": behind, "catch_up_s": round(caught, 3),
                                    "deletes_catch_up_s": round(time.perf_counter() - t0, 3)}
            log(f"{n} captures: caught up in {caught:.3f} s; their deletes in {out[f'captures_{n}']['deletes_catch_up_s']} s")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", type=Path, required=True, help="a bench_search_scale.py --keep data directory")
    ap.add_argument("--bursts", default="1,100,1000", help="captures per burst, comma-separated")
    args = ap.parse_args()
    print("settings changed: embedder=hash (the set was loaded with it; embeddings play no part here)")
    print(json.dumps(asyncio.run(run(args.data_dir, [int(x) for x in args.bursts.split(",")]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
