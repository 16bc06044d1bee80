"""The ``memex`` command: serve, migrate, and organization / key administration from the shell."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

from api.cli_common import add_data_dir, make_memex, print_json, settings_from, with_memex
from api.settings import Settings

__all__ = ["main"]


def _cap_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives each thread that allocates its own malloc arena (up to 8 x cores) and rarely returns their
    memory; the embedder's and the SQL adapter's worker threads made ~300 MB of such slack under a soak
    (bench/bench_soak.py with MALLOC_ARENA_MAX=2: 850-950 MB instead of 1.1-1.3 GB). Same as that variable, set
    before the threads start; a no-op off glibc or when the operator set MALLOC_ARENA_MAX."""
    if os.environ.get("MALLOC_ARENA_MAX") or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    _cap_malloc_arenas()
    from api.app import create_app
    from api.server import server_options

    settings = settings_from(args)
    base = settings.public_url or f"http://{args.host}:{args.port}"
    app = create_app(settings)
    print(f"Memex listening on {base}  (sql={settings.sql}, vectors={settings.vectors}, embedder={settings.embedder}, "
          f"data={settings.data_dir.resolve()})")
    print(f"  API docs:     {base}/schema/swagger   (OpenAPI: {base}/schema/openapi.json)")
    print(f"  Get a key:    curl -s -X POST {base}/v1/signup -H 'content-type: application/json' "
          "-d '{\"name\": \"Acme\", \"slug\": \"acme\"}'")
    print(f"  MCP endpoint: {base}/orgs/<slug>/mcp  (Authorization: Bearer <key>)")
    sys.stdout.flush()
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False, **server_options())
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    """Upgrade the control database and every organization's (resumable: each file commits with its record;
    run it again after an interruption). ``--status`` only lists versions."""
    from services.storage.migrate import CONTROL_DIR, applied, discover

    async def go():
        memex = make_memex(settings_from(args))
        try:
            if args.status:
                names = [m.name for m in discover(CONTROL_DIR)]
                done = await applied(memex.control)
                print(f"control: {len([n for n in names if n in done])}/{len(names)} applied"
                      + (f", pending: {', '.join(n for n in names if n not in done)}" if set(names) - done else ""))
                for st in await memex.stores.status():
                    latest = st.applied[-1] if st.applied else "none"
                    print(f"{st.org_id} ({st.backend} {st.location}): latest {latest}"
                          + (f", pending: {', '.join(st.pending)}" if st.pending else ", up to date"))
                return 0
            ran = await memex.start(worker=False)  # the control database, then a single-database layout's conversion
            print("control: " + (", ".join(ran) if ran else "up to date"))
            ids = await memex.stores.org_ids()
            for i, org_id in enumerate(ids, 1):
                store = await memex.stores.open(org_id)  # applies what is pending
                print(f"\rorganizations: {i}/{len(ids)} up to date", end="", file=sys.stderr, flush=True)
                del store
            if ids:
                print(file=sys.stderr)
            print(f"organizations: {len(ids)} up to date")
            return 0
        finally:
            await memex.stop()

    return asyncio.run(go())


def cmd_org_create(args: argparse.Namespace) -> int:
    async def run(memex):
        org, issued = await memex.orgs.create(name=args.name, slug=args.slug)
        return {"organization": {"id": org.id, "slug": org.slug, "name": org.name, "created_at": org.created_at},
                "api_key": {"id": issued.record.id, "key": issued.raw, "scopes": issued.record.scopes}}

    print_json(asyncio.run(with_memex(settings_from(args), run)))
    print("Store the key now: it is not shown again.", file=sys.stderr)
    return 0


def _org_keys(memex, slug: str):
    async def get():
        org = await memex.orgs.by_slug(slug)
        return memex.keys.for_org(org.id)

    return get()


def cmd_key_create(args: argparse.Namespace) -> int:
    async def run(memex):
        keys = await _org_keys(memex, args.org)
        issued = await keys.create(name=args.name, scopes=args.scopes.split(","), expires_at=args.expires_at)
        return {"id": issued.record.id, "key": issued.raw, "scopes": issued.record.scopes, "expires_at": issued.record.expires_at}

    print_json(asyncio.run(with_memex(settings_from(args), run)))
    return 0


def cmd_key_list(args: argparse.Namespace) -> int:
    async def run(memex):
        keys = await _org_keys(memex, args.org)
        return [dataclasses.asdict(r) for r in await keys.list()]

    print_json(asyncio.run(with_memex(settings_from(args), run)))
    return 0


def cmd_key_revoke(args: argparse.Namespace) -> int:
    async def run(memex):
        keys = await _org_keys(memex, args.org)
        r = await keys.revoke(args.key_id)
        return {"id": r.id, "revoked_at": r.revoked_at}

    print_json(asyncio.run(with_memex(settings_from(args), run)))
    return 0


def openapi_document() -> str:
    """The OpenAPI document of the app, as committed in openapi/openapi.json."""
    from api.app import create_app

    app = create_app(Settings())
    return json.dumps(app.openapi_schema.to_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def cmd_openapi(args: argparse.Namespace) -> int:
    text = openapi_document()
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}")
    return 0


def cmd_cloudflare_check(args: argparse.Namespace) -> int:
    from api.composition.check import run_check  # builds the Cloudflare adapters: loaded for this command only

    return run_check(settings_from(args), fix=args.fix, as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memex", description="Memex: multi-tenant memory for AI agents")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="apply migrations and serve the API and MCP")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--log-level", default="info")
    add_data_dir(s)
    s.set_defaults(fn=cmd_serve)

    m = sub.add_parser("migrate", help="upgrade the control database and every organization's (resumable)")
    m.add_argument("--status", action="store_true", help="list each database's applied and pending migrations")
    add_data_dir(m)
    m.set_defaults(fn=cmd_migrate)

    o = sub.add_parser("openapi", help="write the OpenAPI document (committed as openapi/openapi.json)")
    o.add_argument("--output", default="openapi/openapi.json")
    o.set_defaults(fn=cmd_openapi)

    org = sub.add_parser("org", help="organizations").add_subparsers(dest="org_command", required=True)
    oc = org.add_parser("create", help="create an organization and its first admin key")
    oc.add_argument("--name", required=True)
    oc.add_argument("--slug", required=True)
    add_data_dir(oc)
    oc.set_defaults(fn=cmd_org_create)

    from api.org_lifecycle_cli import add_commands as add_org_lifecycle_commands

    add_org_lifecycle_commands(org)  # org export / import / delete

    cf = sub.add_parser("cloudflare", help="Cloudflare backend operations").add_subparsers(dest="cf_command", required=True)
    cc = cf.add_parser("check", help="verify token, D1 database, migrations, Vectorize index and metadata indexes")
    cc.add_argument("--fix", action="store_true", help="apply missing migrations and create missing metadata indexes")
    cc.add_argument("--json", action="store_true")
    add_data_dir(cc)
    cc.set_defaults(fn=cmd_cloudflare_check)

    from api.reindex_cli import add_commands as add_reindex_commands

    add_reindex_commands(sub)

    from api.enrichment_cli import add_commands as add_enrich_commands

    add_enrich_commands(sub)

    from api.conversations_cli import add_commands as add_conversation_commands

    add_conversation_commands(sub)

    from api.import_cli import add_commands as add_import_commands

    add_import_commands(sub)  # import FILE: thoughts and conversations from JSON Lines

    from api.knowledge_cli import add_commands as add_knowledge_commands

    add_knowledge_commands(sub)  # kb create / sync / import / list / status

    key = sub.add_parser("key", help="API keys").add_subparsers(dest="key_command", required=True)
    kc = key.add_parser("create", help="create a key (printed once)")
    kc.add_argument("--org", required=True, help="organization slug")
    kc.add_argument("--name", required=True)
    kc.add_argument("--scopes", default="read,write", help="comma-separated: read,write,admin")
    kc.add_argument("--expires-at", type=int, default=None, help="epoch ms")
    add_data_dir(kc)
    kc.set_defaults(fn=cmd_key_create)
    kl = key.add_parser("list", help="list keys (never a secret)")
    kl.add_argument("--org", required=True)
    add_data_dir(kl)
    kl.set_defaults(fn=cmd_key_list)
    kr = key.add_parser("revoke", help="revoke a key")
    kr.add_argument("--org", required=True)
    kr.add_argument("key_id")
    add_data_dir(kr)
    kr.set_defaults(fn=cmd_key_revoke)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("mcp").setLevel(logging.WARNING)  # four INFO lines per stateless MCP request otherwise
    args = build_parser().parse_args(argv)
    from services.errors import MemexError

    try:
        return args.fn(args)
    except MemexError as exc:
        print(f"error: {exc.message} {json.dumps(exc.details) if exc.details else ''}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
