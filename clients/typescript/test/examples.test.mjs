// The adapters' examples (examples/typescript/, stub models, no network) against the live server: each exits 0
// only when its runs ended as it expects (completed; awaiting a person; compensated after a failed step).
import { spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import assert from "node:assert/strict";

const examples = join(process.env.UNWIND_REPO, "examples/typescript");
const installed = existsSync(join(examples, "node_modules/@unwind/client"));
const skip = installed ? false : "examples/typescript has no node_modules: run `npm ci` there (scripts/ci.sh does)";

function example(file) {
  const ran = spawnSync(process.execPath, [file], { cwd: examples, encoding: "utf8", timeout: 120_000 });
  assert.equal(ran.status, 0, `${file} exited ${ran.status}\n${ran.stdout}\n${ran.stderr}`);
  return ran.stdout;
}

test("the Vercel AI SDK example: a run completed, a charge waiting for a person, told to the model", { skip }, () => {
  const out = example("ai_sdk_agent.mjs");
  assert.match(out, /Onboard Ana Lima\n {2}run \d+: completed/);
  assert.match(out, /payments_charge -> \{"status":"pending_approval"/);
  assert.match(out, /model: The charge waits for a person: pending approval at http/);
});

test("the OpenAI Agents SDK example: a run completed, and one unwound after a refused email", { skip }, () => {
  const out = example("openai_agents_agent.mjs");
  assert.match(out, /Onboard Ana Lima\n {2}run \d+: completed/);
  assert.match(out, /Onboard Bo and welcome him\n {2}run \d+: compensated\n {2}model: I could not finish: error: email.send failed/);
});
