// The canonical JSON and digest, byte for byte against the server's own code (ledger/canonical.py), run by Python.
import { execFileSync } from "node:child_process";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import assert from "node:assert/strict";
import { digest, dumps, deriveKey, canonical } from "../dist/index.js";

const repo = process.env.UNWIND_REPO;
const python = process.env.PYTHON || [join(repo, ".venv/bin/python")].find(existsSync) || "python3";

const VALUES = [
  { b: 1, a: [1.0, 2.5, -0, 0.1, 1e-5, 0.0001, 1e-7, 1.5e-7, 123456789.123, 1e21, 1e16, 2 ** 53 + 2, 5e-324,
    1.7976931348623157e308, -3.25, 100, 1e300] },
  { "Zoë": "Zoe\u0308", "e\u0301": "é", "\u{1F600}": 1, "\uFFFD": 2, "z": 3, "A": 4, "": 5 },
  ["tab\t", "nl\n", "quote\"", "back\\", "ctl\u0001\u001f", "del\u007f", "ls\u2028", "ascii"],
  { nested: { deep: [{ y: true, x: false, w: null }] }, empty: {}, list: [] },
];

function python_(script, input) {
  return execFileSync(python, ["-c", script], { cwd: repo, input, encoding: "utf8" });
}

test("dumps writes exactly what the server's canonical dumps writes", () => {
  const theirs = python_("import sys, json; from ledger.canonical import dumps\n" +
    "for line in sys.stdin: print(dumps(json.loads(line)))", VALUES.map((v) => JSON.stringify(v)).join("\n") + "\n");
  assert.deepEqual(VALUES.map(dumps), theirs.trimEnd().split("\n"));
});

test("digest and the derived key are the server's", async () => {
  const args = { to: "ana@example.com", subject: "Olá", body: "x", extra: { ratio: 0.00001 } };
  const theirs = python_("import sys, json; from ledger.canonical import digest\n" +
    "a = json.loads(sys.stdin.read()); print(digest(7, 42, 'email.send', '', a)); print(digest(7, 42, 'email.send_keyed', '', " +
    "{'to': a['to'], 'subject': a['subject']}, {'repeat_of': 9}))", JSON.stringify(args)).trim().split("\n");
  assert.equal(await digest(7, 42, "email.send", "", args), theirs[0]);
  assert.equal(await deriveKey({ tenantId: 7, runId: 42, tool: "email.send_keyed", args, repeatOf: 9,
    policy: { keyFields: ["to", "subject"] } }), "uw-" + theirs[1]);
});

test("refuses what the server cannot store", () => {
  assert.throws(() => canonical({ a: "nul\u0000" }), /NUL/);
  assert.throws(() => canonical(["lone \uD800 surrogate"]), /surrogate/);
  assert.throws(() => canonical({ n: NaN }), /not a JSON number/);
});
