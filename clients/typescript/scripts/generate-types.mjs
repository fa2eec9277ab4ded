// Types from the OpenAPI schema the server serves (drf-spectacular), so they cannot drift from it.
//   node scripts/generate-types.mjs          write src/generated/openapi.ts
//   node scripts/generate-types.mjs --check  regenerate and fail (exit 1) if the committed file differs
// The server's schema comes from `manage.py spectacular`, run by $PYTHON (default: the repository's .venv).
import { execFileSync } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const pkg = resolve(here, "..");
const repo = resolve(pkg, "../..");
const target = join(pkg, "src/generated/openapi.ts");
const check = process.argv.includes("--check");
const python = process.env.PYTHON || [join(repo, ".venv/bin/python")].find(existsSync) || "python3";

const work = mkdtempSync(join(tmpdir(), "unwind-openapi-"));
try {
  const schema = join(work, "schema.yml");
  execFileSync(python, ["manage.py", "spectacular", "--validate", "--file", schema], {
    cwd: repo, stdio: ["ignore", "inherit", "inherit"],
    env: { ...process.env, UNWIND_INSECURE_DEV_KEY: process.env.UNWIND_INSECURE_DEV_KEY || "1" },
  });
  const out = join(work, "openapi.ts");
  execFileSync(process.execPath, [join(pkg, "node_modules/openapi-typescript/bin/cli.js"), schema, "-o", out],
    { cwd: pkg, stdio: ["ignore", "ignore", "inherit"] });
  const header = "// Generated from the server's OpenAPI schema by scripts/generate-types.mjs: do not edit.\n" +
    "// `npm run generate` rewrites it; `npm run check-types` (make test, .ci/run) fails when it is stale.\n";
  const fresh = header + readFileSync(out, "utf8");
  if (check) {
    const committed = existsSync(target) ? readFileSync(target, "utf8") : "";
    if (committed !== fresh) {
      const a = committed.split("\n"), b = fresh.split("\n");
      let line = 0;
      while (line < a.length && a[line] === b[line]) line++;
      console.error(`src/generated/openapi.ts is stale: the server's OpenAPI schema changed (first difference at ` +
        `line ${line + 1}: committed ${JSON.stringify(a[line] ?? "<end>")}, fresh ${JSON.stringify(b[line] ?? "<end>")}). ` +
        `Run \`npm run generate\` in clients/typescript and commit the result.`);
      process.exit(1);
    }
    console.log("src/generated/openapi.ts matches the server's OpenAPI schema");
  } else {
    writeFileSync(target, fresh);
    console.log(`wrote ${target}`);
  }
} finally {
  rmSync(work, { recursive: true, force: true });
}
