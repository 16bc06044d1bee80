"""Migrations: NNNN_name.sql files applied in order and recorded in ``d1_migrations`` exactly as
``wrangler d1 migrations apply`` records them, so wrangler and the service agree on what has run.

Three streams, one folder each under migrations/:

* ``control/``: the control database (organizations, keys, bindings, usage, the routing of organizations to
  their databases). wrangler.toml points the D1 binding's ``migrations_dir`` here.
* ``org/``: every organization's own database. Applied to each one when it is created, by ``memex migrate``,
  and when the service first opens it after an upgrade.
* ``legacy/``: the single-database layout before one database per organization; only the converter
  (services.storage.convert) applies them, to bring an old database to its last version before moving it.

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

__all__ = ["MIGRATIONS_DIR", "CONTROL_DIR", "ORG_DIR", "LEGACY_DIR", "Migration", "discover", "applied", "apply_pending",
           "pending", "apply_all_fresh"]



def _default_dir() -> Path:
    """The installed ``memex_migrations`` package (pyproject maps the repository's migrations/ to it, so an
    editable install points back at the folder wrangler reads), else migrations/ beside services/."""
    spec = importlib.util.find_spec("memex_migrations")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[2] / "migrations"


MIGRATIONS_DIR = Path(os.environ.get("MEMEX_MIGRATIONS_DIR") or _default_dir())
CONTROL_DIR = MIGRATIONS_DIR / "control"
ORG_DIR = MIGRATIONS_DIR / "org"
LEGACY_DIR = MIGRATIONS_DIR / "legacy"
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


def discover(directory: Path = ORG_DIR) -> list[Migration]:
    found = []
    for p in directory.glob("*.sql"):
        m = _NAME.match(p.name)
        if m:
            found.append(Migration(int(m.group(1)), p.name, p))
    return sorted(found, key=lambda m: m.number)


async def applied(db: SqlDatabase) -> set[str]:
    await db.execute(_TABLE)
    return {r["name"] for r in (await db.execute("SELECT name FROM d1_migrations")).rows}


async def pending(db: SqlDatabase, directory: Path = ORG_DIR) -> list[str]:
    """The migrations of ``directory`` not yet recorded in ``db``."""
    done = await applied(db)
    return [m.name for m in discover(directory) if m.name not in done]


async def apply_all_fresh(db: SqlDatabase, directory: Path = ORG_DIR) -> list[str]:
    """A database just created (nothing in it): every migration of ``directory`` and its record in one atomic
    script, without first asking what is applied (on D1 that makes a new organization's database one request
    instead of two plus one per file). A database that is not empty fails it whole and is left as it was."""
    migs = discover(directory)
    script = _TABLE + ";\n" + "".join(
        f"{m.sql()}\nINSERT INTO d1_migrations (name) values ('{m.name.replace(chr(39), chr(39) * 2)}');\n" for m in migs)
    await db.executescript(script)
    return [m.name for m in migs]


async def apply_pending(db: SqlDatabase, directory: Path = ORG_DIR) -> list[str]:
    """Apply every migration of ``directory`` not yet recorded (the organization stream unless told otherwise);
    returns the names applied now. Resumable: each file commits with its record, so a run stopped between two
    files goes on from the next one."""
    done = await applied(db)
    ran = []
    for mig in discover(directory):
        if mig.name in done:
            continue
        name = mig.name.replace("'", "''")
        await db.executescript(f"{mig.sql()}\nINSERT INTO d1_migrations (name) values ('{name}');\n")
        ran.append(mig.name)
    return ran
