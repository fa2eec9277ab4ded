/**
 * `@unwind/client`: a small client for the Unwind API (needs only the platform's `fetch`).
 *
 *     import { Unwind } from "@unwind/client";
 *
 *     const unwind = new Unwind("http://127.0.0.1:8000", "uw_…");
 *     await unwind.withRun({ goal: "Onboard Ashu", onBehalfOf: "carol@company.com" }, async (run) => {
 *       const user = await run.act("hr.create_user", { email: "ashu@company.com", name: "Ashu Kumar" });
 *       await run.act("licenses.provision", { user_id: user.id });
 *     });
 */
export { Run, Unwind, type ActOptions, type Answer, type RequestOptions, type RunOptions, type UnwindOptions } from "./client.js";
export * from "./errors.js";
export { canonical, deriveKey, digest, dumps, keyMaterial, targetOf, type KeyInput, type KeyPolicy } from "./canonical.js";
export type * from "./types.js";
