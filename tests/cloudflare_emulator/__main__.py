"""python -m tests.cloudflare_emulator --port P [--host 127.0.0.1] [--data-dir DIR] [--vector-lag-ms N]
                                     [--account ACC] [--token TOKEN] [--rate-limit N] [--rate-window S]
                                     [--database ID ...] [--d1-max-databases N] [--[no-]d1-auto-create]"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from .server import DEFAULT_ACCOUNT, DEFAULT_TOKEN, CloudflareEmulator


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.cloudflare_emulator",
                                description="Local Cloudflare REST emulator (D1, Vectorize v2, Workers AI).")
    p.add_argument("--port", type=int, default=0, help="TCP port (0 = pick a free one; the URL is printed)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--data-dir", default=None,
                   help="persist D1 files and Vectorize mutation logs here (default: temp dir, deleted on exit)")
    p.add_argument("--vector-lag-ms", type=float, default=0, help="delay before a Vectorize mutation applies")
    p.add_argument("--account", action="append", default=None, help=f"account id (repeatable; default {DEFAULT_ACCOUNT})")
    p.add_argument("--token", action="append", default=None, help=f"API token (repeatable; default {DEFAULT_TOKEN})")
    p.add_argument("--rate-limit", type=int, default=1200, help="requests per window per token (default 1200)")
    p.add_argument("--rate-window", type=float, default=300.0, help="rate-limit window/block seconds (default 300)")
    p.add_argument("--database", action="append", default=None,
                   help="preset D1 database id (repeatable). Without it any non-UUID id exists lazily.")
    p.add_argument("--d1-max-databases", type=int, default=50_000,
                   help="D1 databases per account before create answers 7406 (default 50000; Free plan: 10)")
    p.add_argument("--d1-auto-create", action=argparse.BooleanOptionalAction, default=None,
                   help="create a never-seen non-UUID database id on first use (default: on without --database)")
    args = p.parse_args(argv)

    emu = CloudflareEmulator(account=args.account, token=args.token, data_dir=args.data_dir,
                             vector_lag_ms=args.vector_lag_ms, rate_limit=args.rate_limit,
                             rate_window_s=args.rate_window, databases=args.database,
                             d1_auto_create=args.d1_auto_create, d1_max_databases=args.d1_max_databases,
                             host=args.host, port=args.port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    emu.start()
    print(emu.base_url, flush=True)
    print(f"# admin: {emu.admin_url}  account: {emu.account}  token: {emu.token}", file=sys.stderr, flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        emu.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
