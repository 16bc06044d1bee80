"""Local emulator of Cloudflare's REST API (D1, Vectorize v2, Workers AI) for tests.

Written only from /work/shared/reference/cloudflare-rest.md (+ README traps, wrangler.md). See README.md here.

    from tests.cloudflare_emulator import CloudflareEmulator, running_emulator

    with running_emulator(vector_lag_ms=500) as emu:
        emu.base_url        # http://127.0.0.1:PORT/client/v4
        emu.account, emu.token, emu.headers
"""

from .server import DEFAULT_ACCOUNT, DEFAULT_TOKEN, CloudflareEmulator, running_emulator

__all__ = ["CloudflareEmulator", "running_emulator", "DEFAULT_ACCOUNT", "DEFAULT_TOKEN"]
