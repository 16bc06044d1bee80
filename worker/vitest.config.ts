import { defineConfig } from "vitest/config";
import { cloudflareTest, readD1Migrations } from "@cloudflare/vitest-pool-workers";

// Tests run inside workerd (miniflare): D1 and SQLite Durable Objects are simulated; Vectorize and Workers AI
// are fakes passed to the handler (test/fakes.ts). Control migrations are applied in test/setup.ts.
export default defineConfig(async () => {
  const controlMigrations = await readD1Migrations(new URL("../migrations/control", import.meta.url).pathname);
  return {
    plugins: [
      cloudflareTest({
        main: "./src/index.ts",
        miniflare: {
          compatibilityDate: "2026-04-01",
          compatibilityFlags: ["nodejs_compat"],
          d1Databases: ["CONTROL"],
          durableObjects: { ORG: { className: "OrgStore", useSQLite: true } },
          bindings: {
            MEMEX_WORKER_SECRET: "test-secret-0123456789abcdef0123456789abcdef",
            TEST_CONTROL_MIGRATIONS: controlMigrations,
          },
        },
      }),
    ],
    test: { setupFiles: ["./test/setup.ts"] },
  };
});
