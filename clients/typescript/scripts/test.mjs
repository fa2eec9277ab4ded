// The package's tests against a real Unwind: a fresh database (SQLite in a temp dir, or, when DATABASE_URL names
// PostgreSQL, a database of its own beside it: <name>_ts, dropped and created afresh), seeded by scripts/seed.py,
// served by `manage.py runserver` and a `manage.py worker` on a free port, then `node --test test/`.
//   PYTHON=/path/to/python  (default: the repository's .venv)   TS_TEST_KEEP=1 keeps the server's logs
import { spawn, execFileSync } from "node:child_process";
import { existsSync, mkdtempSync, openSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const pkg = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const repo = resolve(pkg, "../..");
const python = process.env.PYTHON || [join(repo, ".venv/bin/python")].find(existsSync) || "python3";
const work = mkdtempSync(join(tmpdir(), "unwind-ts-"));
const started = Date.now();

function freePort() {
  return new Promise((ok, fail) => {
    const probe = createServer().listen(0, "127.0.0.1", () => { const { port } = probe.address(); probe.close(() => ok(port)); });
    probe.on("error", fail);
  });
}

/** The database for this run: its URL, and how to remove it afterwards. */
function database() {
  const given = process.env.DATABASE_URL || "";
  if (!given.startsWith("postgres")) return { url: `sqlite:///${join(work, "unwind.sqlite3")}`, drop() {} };
  const url = new URL(given);
  const name = `${url.pathname.slice(1) || "unwind"}_ts`;
  const admin = new URL(given); admin.pathname = "/postgres";
  const sql = (statement) => execFileSync(python, ["-c",
    "import sys, psycopg; c = psycopg.connect(sys.argv[1], autocommit=True); c.execute(sys.argv[2])", admin.href, statement],
    { stdio: ["ignore", "inherit", "inherit"] });
  sql(`DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`);
  sql(`CREATE DATABASE "${name}"`);
  url.pathname = `/${name}`;
  return { url: url.href, drop: () => sql(`DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`) };
}

const db = database();
const port = await freePort();
const base = `http://127.0.0.1:${port}`;
const env = { ...process.env, DATABASE_URL: db.url, UNWIND_INSECURE_DEV_KEY: "1", UNWIND_SANDBOX: "1",
  UNWIND_BASE_URL: base, UNWIND_TOOL_BASE_URL: base, UNWIND_TASKS_SYNC: "0", PYTHONUNBUFFERED: "1",
  EMAIL_BACKEND: "django.core.mail.backends.locmem.EmailBackend" };
const seeded = JSON.parse(execFileSync(python, ["manage.py", "shell", "-c",
  "exec(open('clients/typescript/scripts/seed.py').read())"], { cwd: repo, env, encoding: "utf8" }).trim().split("\n").pop());
console.log(`# seeded ${db.url.startsWith("sqlite") ? "SQLite" : "PostgreSQL"} in ${((Date.now() - started) / 1000).toFixed(1)} s`);

const children = [];
const log = (name) => openSync(join(work, `${name}.log`), "w");
for (const [name, args] of [["web", ["runserver", `127.0.0.1:${port}`, "--noreload"]], ["worker", ["worker"]]]) {
  const out = log(name);
  children.push(spawn(python, ["manage.py", ...args], { cwd: repo, env, stdio: ["ignore", out, out], detached: true }));
}
function stop() {
  for (const child of children) {
    try { process.kill(-child.pid, "SIGTERM"); } catch { /* already gone */ }
  }
}
process.on("exit", stop);
for (const signal of ["SIGINT", "SIGTERM"]) process.on(signal, () => { stop(); process.exit(130); });

let rc = 1;
try {
  const deadline = Date.now() + 60_000;
  for (;;) {
    try { if ((await fetch(`${base}/healthz`)).ok) break; } catch { /* not yet */ }
    if (Date.now() > deadline || children.some((c) => c.exitCode !== null)) throw new Error(`${base} did not start`);
    await new Promise((r) => setTimeout(r, 200));
  }
  const files = readdirSync(join(pkg, "test")).filter((f) => f.endsWith(".test.mjs")).map((f) => join("test", f));
  const tests = spawn(process.execPath, ["--test", "--test-concurrency=1", ...files], { cwd: pkg, stdio: "inherit",
    env: { ...process.env, UNWIND_URL: base, UNWIND_AGENT_KEY: seeded.key, UNWIND_OTHER_AGENT_KEY: seeded.other_key,
      UNWIND_TENANT_ID: String(seeded.tenant_id), UNWIND_PASSWORD: seeded.password, UNWIND_REPO: repo } });
  rc = await new Promise((ok) => tests.on("exit", (code) => ok(code ?? 1)));
} catch (error) {
  console.error(String(error));
} finally {
  stop();
  await new Promise((r) => setTimeout(r, 300));
  if (rc !== 0) {
    for (const name of ["web", "worker"]) {
      console.error(`--- ${name}.log (tail)`);
      console.error(readFileSync(join(work, `${name}.log`), "utf8").split("\n").slice(-40).join("\n"));
    }
  }
  try { db.drop(); } catch (error) { console.error(`could not drop the test database: ${error}`); }
  if (!process.env.TS_TEST_KEEP) rmSync(work, { recursive: true, force: true });
  else console.error(`logs kept in ${work}`);
  console.log(`# TypeScript client tests: ${rc === 0 ? "passed" : "FAILED"} in ${((Date.now() - started) / 1000).toFixed(1)} s`);
}
process.exit(rc);
