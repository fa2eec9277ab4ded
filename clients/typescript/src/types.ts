/** The API's shapes, from the generated OpenAPI types (src/generated/openapi.ts). */
import type { components } from "./generated/openapi.js";

type S = components["schemas"];
export type Action = S["ActionOut"] & Partial<Pick<S["ProposalOut"], "replayed" | "matched_by">>;
export type Proposal = S["ProposalOut"];
export type RunData = S["RunOut"] & Partial<Pick<S["RunDetailOut"], "actions" | "checkpoints" | "moves">>;
export type RunDetail = S["RunDetailOut"];
export type Trail = S["TrailOut"];
export type Tool = S["ToolOut"];
export type Problem = Partial<S["Problem"]> & Record<string, unknown>;
export type PendingCompensation = S["PendingCompensationOut"];
export type Intent = S["IntentIn"];
export type ActionStatus = S["ActionStatusEnum"];
export type RunStatus = S["RunStatusEnum"];
export type { components, paths } from "./generated/openapi.js";
