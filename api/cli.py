"""The ``memex`` command: serve, migrate, and organization / key administration from the shell."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shlex
import socket
import sys
from pathlib import Path

from api.cli_common import add_data_dir, add_json, dumps, emit, make_memex, parse_duration, settings_from, table, with_memex
from api.settings import Settings

__all__ = ["main"]


def _listen_socket(host: str, port: int) -> socket.socket:
    """The serving socket, bound before the banner: the banner then names the port listened on (``--port 0``: the
    one the system picked), and a taken port fails here, before anything claims to listen. (uvicorn's
    ``Config.bind_socket`` does the same but logs its own "running on" line ahead of the banner.) The protocol is
    named, not left 0: asyncio sets TCP_NODELAY on an accepted connection only when its socket says IPPROTO_TCP, and
    without it a response waits on the client's delayed ACK (captures from 4 clients: p50 10 -> 43 ms)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from api.heap import HeapTrimmer, cap_malloc_arenas

    cap_malloc_arenas()
    from api.app import create_app
    from api.server import server_options

    settings = settings_from(args)
    app = create_app(settings)
    # log_config=None: uvicorn's own lines go through the service's logging (text, or JSON with MEMEX_LOG_FORMAT=json)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            log_config=None, **server_options())
    sock = _listen_socket(args.host, args.port)
    host = f"[{args.host}]" if ":" in args.host else args.host
    base = settings.public_url or f"http://{host}:{sock.getsockname()[1]}"
    print(f"Memex listening on {base}  (sql={settings.sql}, vectors={settings.vectors}, embedder={settings.embedder}, "
          f"data={settings.data_dir.resolve()})")
    print(f"  Console:      {base}/   (sign up, keys, thoughts, search, connect an agent)")
    print(f"  API docs:     {base}/docs   (OpenAPI: {base}/schema/openapi.json)")
    print(f"  Sign up:      eval \"$(memex signup --name Acme --slug acme --url {base})\"   "
          "(exports MEMEX_URL, MEMEX_KEY, MEMEX_MCP_URL)")
    print(f"  MCP endpoint: {base}/orgs/<slug>/mcp  (Authorization: Bearer <key>)")
    sys.stdout.flush()
    trimmer = HeapTrimmer().start()
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        trimmer.stop()
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    """Upgrade the control database and every organization's (resumable: each file commits with its record;
    run it again after an interruption). ``--status`` only lists versions."""
    from api.cli_common import json_quiet, progress
    from services.storage.migrate import CONTROL_DIR, applied, discover

    async def go():
        memex = make_memex(settings_from(args))
        try:
            if args.status:
                names = [m.name for m in discover(CONTROL_DIR)]
                done = await applied(memex.control)
                orgs = [{"organization": st.org_id, "backend": st.backend, "location": st.location,
                         "latest": st.applied[-1] if st.applied else None, "pending": list(st.pending)}
                        for st in await memex.stores.status()]
                return {"control": {"applied": len([n for n in names if n in done]), "total": len(names),
                                    "pending": [n for n in names if n not in done]}, "organizations": orgs}
            ran = await memex.start(worker=False)  # the control database, then a single-database layout's conversion
            ids = await memex.stores.org_ids()
            with progress(len(ids), "organizations", "orgs", show=json_quiet(args)) as bar:
                for org_id in ids:
                    store = await memex.stores.open(org_id)  # applies what is pending
                    del store
                    bar.update(1)
            return {"control": {"applied_now": list(ran)}, "organizations": {"up_to_date": len(ids)}}
        finally:
            await memex.stop()

    emit(asyncio.run(go()), args, human=_migrate_text)
    return 0


def _migrate_text(report: dict) -> str:
    control, orgs = report["control"], report["organizations"]
    if "applied_now" in control:
        return "\n".join([f"control: {', '.join(control['applied_now']) or 'up to date'}",
                          f"organizations: {orgs['up_to_date']} up to date"])
    lines = [f"control: {control['applied']}/{control['total']} applied"
             + (f", pending: {', '.join(control['pending'])}" if control["pending"] else "")]
    for st in orgs:
        lines.append(f"{st['organization']} ({st['backend']} {st['location']}): latest {st['latest'] or 'none'}"
                     + (f", pending: {', '.join(st['pending'])}" if st["pending"] else ", up to date"))
    return "\n".join(lines)


def cmd_org_create(args: argparse.Namespace) -> int:
    async def run(memex):
        org, issued = await memex.orgs.create(name=args.name, slug=args.slug)
        return {"organization": {"id": org.id, "slug": org.slug, "name": org.name, "created_at": org.created_at},
                "api_key": {"id": issued.record.id, "key": issued.raw, "scopes": issued.record.scopes}}

    emit(asyncio.run(with_memex(settings_from(args), run)), args)
    print("Store the key now: it is not shown again.", file=sys.stderr)
    return 0


def _org_keys(memex, slug: str):
    async def get():
        org = await memex.orgs.by_slug(slug)
        return memex.keys.for_org(org.id)

    return get()


#: The longest expiry a key may have (the API's ``expires_in_seconds`` bound).
MAX_KEY_SECONDS = 10 * 365 * 86400


def cmd_key_create(args: argparse.Namespace) -> int:
    from services.ids import now_ms

    if args.expires_in is not None and args.expires_in > MAX_KEY_SECONDS:
        print("error: --expires-in: at most 3650d (ten years)", file=sys.stderr)
        return 2

    async def run(memex):
        keys = await _org_keys(memex, args.org)
        expires_at = now_ms() + args.expires_in * 1000 if args.expires_in else None
        issued = await keys.create(name=args.name, scopes=args.scopes.split(","), expires_at=expires_at)
        return {"id": issued.record.id, "key": issued.raw, "scopes": issued.record.scopes, "expires_at": issued.record.expires_at}

    emit(asyncio.run(with_memex(settings_from(args), run)), args)
    print("Store the key now: it is not shown again.", file=sys.stderr)
    return 0


KEY_COLUMNS = [("ID", "id"), ("NAME", "name"), ("PREFIX", "prefix"), ("SCOPES", "scopes"), ("CREATED", "created_at"),
               ("EXPIRES", "expires_at"), ("LAST USED", "last_used_at"), ("REVOKED", "revoked_at")]


def cmd_key_list(args: argparse.Namespace) -> int:
    async def run(memex):
        keys = await _org_keys(memex, args.org)
        return [{k: v for k, v in dataclasses.asdict(r).items() if k != "organization_id"} for r in await keys.list()]

    emit(asyncio.run(with_memex(settings_from(args), run)), args, human=lambda rows: table(rows, KEY_COLUMNS))
    return 0


def cmd_key_revoke(args: argparse.Namespace) -> int:
    async def run(memex):
        keys = await _org_keys(memex, args.org)
        r = await keys.revoke(args.key_id)
        return {"id": r.id, "revoked_at": r.revoked_at}

    emit(asyncio.run(with_memex(settings_from(args), run)), args)
    return 0


# -- sign-up through a running service ------------------------------------------------------------------------

DEFAULT_URL = "http://127.0.0.1:8080"


def signup_exports(body: dict, url: str) -> str:
    """The shell lines ``eval "$(memex signup ...)"`` runs: the service's URL, the key, the organization's MCP URL."""
    lines = [("MEMEX_URL", url), ("MEMEX_KEY", body["api_key"]["key"]),
             ("MEMEX_MCP_URL", body.get("mcp_url") or f"{url}/orgs/{body['organization']['slug']}/mcp")]
    return "\n".join(f"export {name}={shlex.quote(value)}" for name, value in lines)


def cmd_signup(args: argparse.Namespace) -> int:
    """``POST /v1/signup`` on a running service; prints ``export`` lines for ``eval`` (or the answer, ``--json``).
    The service down, or refusing (a slug taken, a rate limit): one line on stderr, exit 1."""
    import httpx

    url = (args.url or os.environ.get("MEMEX_URL") or DEFAULT_URL).rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    try:
        r = httpx.post(f"{url}/v1/signup", json={"name": args.name, "slug": args.slug}, timeout=args.timeout)
    except httpx.HTTPError as exc:
        print(f"memex signup: cannot reach the Memex service at {url} ({type(exc).__name__}: {exc}); "
              "is `memex serve` running? (--url or MEMEX_URL)", file=sys.stderr)
        return 1
    try:
        body = r.json()
    except ValueError:
        body = None
    if r.status_code != 201 or not isinstance(body, dict) or "api_key" not in body:
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict):
            detail = f"{error.get('code')}: {error.get('message')}"
        else:
            detail = (r.text or r.reason_phrase).strip().splitlines()[0][:200] if (r.text or r.reason_phrase) else ""
        print(f"memex signup: {url} refused the sign-up ({r.status_code}) {detail}".rstrip(), file=sys.stderr)
        return 1
    if args.json:
        print(dumps({**body, "url": url}))
    else:
        print(signup_exports(body, url))
        org = body["organization"]
        print(f"# signed up {org['name']} ({org['slug']}); the key is shown this once: keep it "
              "(eval \"$(memex signup ...)\" exports MEMEX_URL, MEMEX_KEY and MEMEX_MCP_URL)", file=sys.stderr)
    return 0


# -- the OpenAPI document ----------------------------------------------------------------------------------------

#: The source checkout this package runs from (an editable install), if any: where the committed document lives.
CHECKOUT = Path(__file__).resolve().parents[1]
COMMITTED_OPENAPI = CHECKOUT / "openapi" / "openapi.json"


def openapi_document() -> str:
    """The OpenAPI document of the app, as committed in openapi/openapi.json."""
    from api.app import create_app

    app = create_app(Settings())
    return json.dumps(app.openapi_schema.to_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _in_checkout() -> bool:
    """Run from inside the source checkout (the working directory at or under it), which has the committed file."""
    if not (COMMITTED_OPENAPI.parent.is_dir() and (CHECKOUT / "pyproject.toml").is_file()):
        return False
    try:
        Path.cwd().resolve().relative_to(CHECKOUT)
    except (ValueError, OSError):
        return False
    return True


def cmd_openapi(args: argparse.Namespace) -> int:
    """``--output PATH`` (``-``: stdout); without it, the committed openapi/openapi.json when run inside the source
    checkout, stdout anywhere else."""
    target = args.output if args.output is not None else (str(COMMITTED_OPENAPI) if _in_checkout() else "-")
    text = openapi_document()
    if target == "-":
        sys.stdout.write(text)
        return 0
    path = Path(target)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        print(f"memex openapi: cannot write {target}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}", file=sys.stderr)
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
    add_json(m)
    add_data_dir(m)
    m.set_defaults(fn=cmd_migrate)

    o = sub.add_parser("openapi", help="print or write the OpenAPI document (committed as openapi/openapi.json)")
    o.add_argument("--output", "-o", default=None, metavar="PATH",
                   help="file to write, - for stdout (default: the checkout's openapi/openapi.json when run inside "
                        "the source checkout, else stdout)")
    o.set_defaults(fn=cmd_openapi)

    su = sub.add_parser("signup", help="sign up on a running service; prints export lines: "
                                       "eval \"$(memex signup --name Acme --slug acme)\"")
    su.add_argument("--name", required=True, help="the organization's name")
    su.add_argument("--slug", required=True, help="its slug: 3-40 of a-z, 0-9 and single hyphens")
    su.add_argument("--url", default=None,
                    help=f"the service's base URL (default: MEMEX_URL, else {DEFAULT_URL})")
    su.add_argument("--timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    add_json(su)
    su.set_defaults(fn=cmd_signup)

    org = sub.add_parser("org", help="organizations").add_subparsers(dest="org_command", required=True)
    oc = org.add_parser("create", help="create an organization and its first admin key")
    oc.add_argument("--name", required=True)
    oc.add_argument("--slug", required=True)
    add_json(oc)
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
    from api.cloudflare_dev_cli import add_command as add_cloudflare_dev_command

    add_cloudflare_dev_command(cf)  # cloudflare dev: the data-plane Worker locally
    from api.cloudflare_migrate_cli import add_command as add_cloudflare_migrate_command

    add_cloudflare_migrate_command(cf)  # cloudflare migrate: a REST-backed deployment into the Worker's stores

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
    kc.add_argument("--expires-in", type=parse_duration, default=None, metavar="DURATION",
                    help="expire after this long: 90m, 12h, 30d, 2w (s, m, h, d, w; default: never)")
    add_json(kc)
    add_data_dir(kc)
    kc.set_defaults(fn=cmd_key_create)
    kl = key.add_parser("list", help="list keys (never a secret)")
    kl.add_argument("--org", required=True)
    add_json(kl)
    add_data_dir(kl)
    kl.set_defaults(fn=cmd_key_list)
    kr = key.add_parser("revoke", help="revoke a key")
    kr.add_argument("--org", required=True)
    kr.add_argument("key_id")
    add_json(kr)
    add_data_dir(kr)
    kr.set_defaults(fn=cmd_key_revoke)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("mcp").setLevel(logging.WARNING)  # four INFO lines per stateless MCP request otherwise
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request (memex signup, Cloudflare) otherwise
    args = build_parser().parse_args(argv)
    from services.errors import MemexError

    try:
        return args.fn(args)
    except MemexError as exc:
        print(f"error: {exc.message} {json.dumps(exc.details, ensure_ascii=False) if exc.details else ''}".rstrip(),
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
