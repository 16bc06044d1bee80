import { applyD1Migrations } from "cloudflare:test";
import { env } from "cloudflare:workers";

// What `wrangler d1 migrations apply` does for the control database (idempotent: records d1_migrations).
await applyD1Migrations((env as any).CONTROL, (env as any).TEST_CONTROL_MIGRATIONS);
