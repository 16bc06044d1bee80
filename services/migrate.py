"""Migrations: migrations/NNNN_name.sql applied in order and recorded in ``d1_migrations`` exactly as
``wrangler d1 migrations apply`` records them, so wrangler and the service agree on what has run.

Each pending file runs as one atomic script together with its ``INSERT INTO d1_migrations`` row (what
wrangler sends as one request); a failing file rolls back and stops the run.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from services.ports import SqlDatabase

__all__ = ["MIGRATIONS_DIR", "Migration", "discover", "applied", "apply_pending"]



def _default_dir() -> Path:
    """The installed ``memex_migrations`` package (pyproject maps the repository's migrations/ to it, so an
    editable install points back at the folder wrangler reads), else migrations/ beside services/."""
    spec = importlib.util.find_spec("memex_migrations")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[1] / "migrations"


MIGRATIONS_DIR = Path(os.environ.get("MEMEX_MIGRATIONS_DIR") or _default_dir())
_NAME = re.compile(r"^(\d{4})_[\w.-]+\.sql$")

_TABLE = (
    "CREATE TABLE IF NOT EXISTS d1_migrations("
    "id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT UNIQUE, "
    "applied_at TIMESTAMP DEFAULT CURRENT_TIMESTAMP NOT NULL)"
)


@dataclass(frozen=True)
class Migration:
    number: int
    name: str
    path: Path

    def sql(self) -> str:
        return self.path.read_text(encoding="utf-8")


def discover(directory: Path = MIGRATIONS_DIR) -> list[Migration]:
    found = []
    for p in directory.glob("*.sql"):
        m = _NAME.match(p.name)
        if m:
            found.append(Migration(int(m.group(1)), p.name, p))
    return sorted(found, key=lambda m: m.number)


async def applied(db: SqlDatabase) -> set[str]:
    await db.execute(_TABLE)
    return {r["name"] for r in (await db.execute("SELECT name FROM d1_migrations")).rows}


async def apply_pending(db: SqlDatabase, directory: Path = MIGRATIONS_DIR) -> list[str]:
    """Apply every migration not yet recorded; returns the names applied now."""
    done = await applied(db)
    ran = []
    for mig in discover(directory):
        if mig.name in done:
            continue
        name = mig.name.replace("'", "''")
        await db.executescript(f"{mig.sql()}\nINSERT INTO d1_migrations (name) values ('{name}');\n")
        ran.append(mig.name)
    return ran
