/**
 * Request and response shapes of `context_engine.v1.ContextEngine`, written to match
 * `proto/context_engine/v1/context_engine.proto`.
 *
 * Conventions (they follow the proto-loader options in `proto.ts`):
 * - field names are camelCase (`tenant_id` is `tenantId`);
 * - enums are their value names (`"TRUST_LEVEL_USER"`); requests also accept the numbers;
 * - 64-bit integers (`int64`, `uint64`) arrive as decimal strings so no value loses precision;
 *   requests accept a string or a number (a number must be a safe integer);
 * - `bytes` arrive as `Buffer`; requests accept a `Uint8Array` or a base64 string;
 * - responses carry every scalar and repeated field, with the proto3 default when unset;
 * - a `oneof` is a set of optional fields of which at most one is given; responses also name
 *   the one that is set in the oneof's own field (`kind: "user"`).
 */

/** A 64-bit integer: a decimal string in responses; a string or a safe integer in requests. */
export type Int64 = string | number;
/** Raw bytes: a `Buffer` in responses; a `Uint8Array` or base64 string in requests. */
export type Bytes = Uint8Array | string;

export type TrustLevel =
  | "TRUST_LEVEL_UNSPECIFIED"
  | "TRUST_LEVEL_PLATFORM"
  | "TRUST_LEVEL_TRUSTED_CONFIGURATION"
  | "TRUST_LEVEL_USER"
  | "TRUST_LEVEL_MEMORY"
  | "TRUST_LEVEL_EXTERNAL_UNTRUSTED";

export type SessionKind =
  | "SESSION_KIND_UNSPECIFIED"
  | "SESSION_KIND_INTERACTIVE"
  | "SESSION_KIND_SCHEDULED"
  | "SESSION_KIND_CHILD"
  | "SESSION_KIND_EMAIL";

export type SideEffect =
  | "SIDE_EFFECT_UNSPECIFIED"
  | "SIDE_EFFECT_NONE"
  | "SIDE_EFFECT_WORKSPACE_READ"
  | "SIDE_EFFECT_NETWORK_READ"
  | "SIDE_EFFECT_WORKSPACE_WRITE"
  | "SIDE_EFFECT_NETWORK_WRITE"
  | "SIDE_EFFECT_EXTERNAL_ACTION";

export type AttachmentKind =
  | "ATTACHMENT_KIND_UNSPECIFIED"
  | "ATTACHMENT_KIND_IMAGE"
  | "ATTACHMENT_KIND_PDF"
  | "ATTACHMENT_KIND_TEXT";

export type ToolOutcomeKind =
  | "TOOL_OUTCOME_KIND_UNSPECIFIED"
  | "TOOL_OUTCOME_KIND_STARTED"
  | "TOOL_OUTCOME_KIND_SUCCEEDED"
  | "TOOL_OUTCOME_KIND_FAILED";

export type ProviderFormat =
  | "PROVIDER_FORMAT_UNSPECIFIED"
  | "PROVIDER_FORMAT_ANTHROPIC_MESSAGES"
  | "PROVIDER_FORMAT_OPENAI_RESPONSES";

export type Role = "ROLE_UNSPECIFIED" | "ROLE_USER" | "ROLE_ASSISTANT" | "ROLE_TOOL";

export type RotationReason =
  | "ROTATION_REASON_UNSPECIFIED"
  | "ROTATION_REASON_SECURITY_REVOCATION"
  | "ROTATION_REASON_MODEL_ROUTED"
  | "ROTATION_REASON_SNAPSHOT_INVALIDATED"
  | "ROTATION_REASON_OPERATOR";

/** An enum in a request: its value name or its number. */
export type EnumIn<E extends string> = E | number;

// ---------------------------------------------------------------------------------- Plan

export interface AgentSpec {
  agentId?: string;
  version?: string;
  instructions?: string;
  enabledTools?: string[];
  deferredTools?: string[];
  enablesToolCall?: boolean;
  /**
   * Opts out of the `context.update_working_state` control tool, which every plan otherwise
   * pins (it counts against the tool caps like any definition).
   */
  omitsWorkingStateTool?: boolean;
}

export interface PersonaEntry {
  key?: string;
  text?: string;
}

export interface Persona {
  revision?: string;
  entries?: PersonaEntry[];
}

export interface ToolSpec {
  name?: string;
  description?: string;
  /** JSON object text of the tool's input schema. */
  inputSchemaJson?: string;
  sideEffect?: EnumIn<SideEffect>;
  server?: string;
  requiredScopes?: string[];
  /** Absent means true. */
  modelVisible?: boolean;
  sessionBinding?: string;
}

export interface ModelCapabilities {
  contextWindow?: number;
  outputReserve?: number;
  breakpointBudget?: number;
}

export interface ModelSpec {
  modelId?: string;
  capabilities?: ModelCapabilities;
}

export interface SessionSpec {
  kind?: EnumIn<SessionKind>;
  websiteProfileId?: string;
}

export interface SkillCatalogEntry {
  name?: string;
  description?: string;
  trust?: EnumIn<TrustLevel>;
}

export interface MemoryItem {
  id?: string;
  text?: string;
}

export interface MemorySnapshot {
  snapshotId?: string;
  recallTraceId?: string;
  watermark?: Int64;
  items?: MemoryItem[];
}

export interface RunAdmission {
  runId?: string;
  toolsPinned?: boolean;
  hasPendingCalls?: boolean;
}

export interface PlanRequest {
  tenantId: string;
  sessionId: string;
  agent?: AgentSpec;
  persona?: Persona;
  toolCatalog?: ToolSpec[];
  principalScopes?: string[];
  model?: ModelSpec;
  session?: SessionSpec;
  skillCatalog?: SkillCatalogEntry[];
  memorySnapshot?: MemorySnapshot;
  run?: RunAdmission;
  invalidatedRecallTraceIds?: string[];
}

export interface PrefixBlock {
  row: number;
  trust: TrustLevel;
  text: string;
}

export interface ToolDefinition {
  name: string;
  description: string;
  /** Canonical JSON (sorted keys, no insignificant whitespace). */
  inputSchemaJson: string;
}

export interface ClassTokens {
  className: string;
  tokens: number;
  cap: number;
  items: number;
  itemCap: number;
}

export interface Timestamp {
  seconds: string;
  nanos: number;
}

export interface ContextPlan {
  tenantId: string;
  sessionId: string;
  epoch: number;
  prefixSha256: string;
  prefixTokens: number;
  prefixClasses: ClassTokens[];
  modelId: string;
  tokenizer: string;
  contextWindow: number;
  outputReserve: number;
  breakpointBudget: number;
  toolNames: string[];
  deferredToolNames: string[];
  skippedToolNames: string[];
  toolSchemaSha256: string;
  authorityScopeHashes: string[];
  policyVersion: string;
  builderVersion: string;
  /** "5m" or "1h". */
  cacheTtl: string;
  /** `session_opened` or a rotation reason. */
  reason: string;
  sessionKey: string;
  createdAt: Timestamp | null;
  prefixBlocks: PrefixBlock[];
  tools: ToolDefinition[];
  agentId: string;
  agentVersion: string;
  personaRevision: string;
  sessionKind: SessionKind;
}

export interface PlanResponse {
  plan: ContextPlan;
  /** True when this call wrote a new epoch. */
  created: boolean;
}

export interface GetPlanRequest {
  tenantId: string;
  sessionId: string;
  /** 0 or absent: the current epoch. */
  epoch?: number;
}

export interface GetPlanResponse {
  plan: ContextPlan;
}

// ---------------------------------------------------------------------------------- Build

export interface ToolCall {
  callId?: string;
  name?: string;
  /** JSON object text of the arguments, replayed verbatim. */
  argumentsJson?: string;
}

export interface Attachment {
  kind?: EnumIn<AttachmentKind>;
  name?: string;
  ref?: string;
  pages?: number;
  textChars?: Int64;
}

export interface UserMessage {
  text?: string;
  attachments?: Attachment[];
}

export interface AssistantMessage {
  text?: string;
}

export interface ToolCalls {
  calls?: ToolCall[];
}

export interface ToolResult {
  callId?: string;
  toolName?: string;
  content?: string;
  artifactRef?: string;
  contextContent?: string;
  eventId?: Int64;
}

export interface ReasoningItem {
  provider?: string;
  opaque?: Bytes;
}

/** One checkpoint item; exactly one of the `kind` fields is set. */
export interface ConversationItem {
  id: string;
  sequence: Int64;
  runId?: string;
  trust?: EnumIn<TrustLevel>;
  user?: UserMessage;
  assistant?: AssistantMessage;
  toolCalls?: ToolCalls;
  toolResult?: ToolResult;
  reasoning?: ReasoningItem;
}

export interface SkillBody {
  name?: string;
  body?: string;
  trust?: EnumIn<TrustLevel>;
}

export interface WorkingTask {
  id?: string;
  title?: string;
  /** open, in_progress, blocked, completed */
  state?: string;
  sequence?: Int64;
  runId?: string;
  /** The label of its title (set by the service; unset means USER). */
  trust?: EnumIn<TrustLevel>;
}

export interface WorkingFact {
  statement?: string;
  sourceEventIds?: Int64[];
  trust?: EnumIn<TrustLevel>;
  sequence?: Int64;
  runId?: string;
}

export interface EntryOrigin {
  sequence?: Int64;
  runId?: string;
  trust?: EnumIn<TrustLevel>;
}

export interface WorkingState {
  objective?: string;
  constraints?: string[];
  tasks?: WorkingTask[];
  facts?: WorkingFact[];
  openQuestions?: string[];
  nextAction?: string;
  supersededObjectives?: string[];
  questionOrigins?: EntryOrigin[];
  /** Labels of the text entries, set by the service (unset means USER, the highest). */
  objectiveTrust?: EnumIn<TrustLevel>;
  constraintTrust?: EnumIn<TrustLevel>[];
  nextActionTrust?: EnumIn<TrustLevel>;
  supersededTrust?: EnumIn<TrustLevel>[];
  /** Constraints the user removed this session (set by the service). */
  removedConstraints?: string[];
}

export interface RecallLine {
  id?: string;
  text?: string;
}

export interface CorrectionLine {
  id?: string;
  text?: string;
}

export interface KnowledgePassage {
  id?: string;
  source?: string;
  text?: string;
  rank?: number;
  trust?: EnumIn<TrustLevel>;
}

export interface RuntimeMetadata {
  currentDate?: string;
  principalScopes?: string[];
  surface?: string;
  browserOrigins?: string[];
}

export interface ElidedSpan {
  itemId?: string;
  trustLevel?: EnumIn<TrustLevel>;
  byteLength?: Int64;
  artifactRef?: string;
  eventId?: Int64;
  kind?: string;
}

/** The compacted history summary, as `Compact` returns it; write it into the checkpoint. */
export interface Summary {
  text?: string;
  replacedThroughSequence?: Int64;
  sourceEventIds?: Int64[];
  depth?: number;
  constraints?: string[];
  elided?: ElidedSpan[];
  /** The narrative's label (set by Compact; at most USER, unset means USER). */
  trust?: EnumIn<TrustLevel>;
  /** One per constraint (or none: USER for each). */
  constraintTrust?: EnumIn<TrustLevel>[];
}

export interface Checkpoint {
  activeRunId?: string;
  items?: ConversationItem[];
  loadedSkills?: SkillBody[];
  workingState?: WorkingState;
  recall?: RecallLine[];
  corrections?: CorrectionLine[];
  knowledge?: KnowledgePassage[];
  runtime?: RuntimeMetadata;
  summary?: Summary;
}

export interface BuildRequest {
  tenantId: string;
  sessionId: string;
  /** 0 or absent: the current epoch. */
  epoch?: number;
  checkpoint?: Checkpoint;
  /** Pins the estimator correction factor so a replay reproduces the bytes. */
  estimatorFactor?: number;
  providerFormat?: EnumIn<ProviderFormat>;
}

export interface ResponseToolCall {
  callId: string;
  name: string;
  argumentsJson: string;
}

export interface ResponseAttachment {
  kind: AttachmentKind;
  name: string;
  ref: string;
  pages: number;
  textChars: string;
}

export interface Message {
  row: number;
  role: Role;
  trust: TrustLevel;
  itemId: string;
  text: string;
  toolCalls: ResponseToolCall[];
  callId: string;
  reasoningProvider: string;
  reasoningOpaque: Buffer;
  attachments: ResponseAttachment[];
}

export interface ModelRequest {
  prefixBlocks: PrefixBlock[];
  tools: ToolDefinition[];
  messages: Message[];
}

export interface CacheBreakpoint {
  /** after_system, after_tools, carried_history or run. */
  name: string;
  /** "5m" or "1h". */
  ttl: string;
  throughItem: string;
  throughInputItem: string;
}

export interface ClassBudget {
  className: string;
  /** 0: uncapped. */
  cap: number;
  used: number;
  items: number;
  yielded: number;
}

export interface BudgetReport {
  totalTokens: number;
  outputReserve: number;
  safetyMarginRatio: number;
  marginTokens: number;
  prefixTokens: number;
  bodyBudget: number;
  bodyTokens: number;
  estimatedTotal: number;
  estimatorFactor: number;
  historyFloor: number;
  classes: ClassBudget[];
}

export interface YieldStep {
  /** knowledge, recall, tool_results or history. */
  step: string;
  units: number;
  itemIds: string[];
  tokensBefore: number;
  tokensAfter: number;
}

export interface Pressure {
  steps: YieldStep[];
  fits: boolean;
  tokensBefore: number;
  tokensAfter: number;
  /** History was cut: compact (a write) and build again to keep what was left out. */
  compactionNeeded: boolean;
  leftOutItems: number;
  leftOutTokens: number;
  /** Index into checkpoint.items of the first retained history item. */
  historyCutIndex: number;
  summaryFloorIndex: number;
  legacyToolExcerpts: number;
  /** What never yields left history this many tokens short of its 8,000-token floor (0: held). */
  historyFloorShortfall: number;
}

export interface BuildResponse {
  request: ModelRequest;
  prefixSha256: string;
  epoch: number;
  modelId: string;
  sessionKey: string;
  prefixTokens: number;
  bodyTokens: number;
  estimatedInputTokens: number;
  contextWindow: number;
  outputReserve: number;
  estimatorFactor: number;
  tokenizer: string;
  budget: BudgetReport;
  pressure: Pressure;
  cacheBreakpoints: CacheBreakpoint[];
  providerBodyJson: string;
}

// ------------------------------------------------------------------------- ReportUsage

export interface ReportUsageRequest {
  tenantId: string;
  sessionId: string;
  epoch?: number;
  estimatedInputTokens?: number;
  estimatorFactor?: number;
  inputTokens?: number;
  cachedTokens?: number;
  outputTokens?: number;
  /** A retried report with the same key is counted once; with a key the call is retried. */
  idempotencyKey?: string;
}

export interface ReportUsageResponse {
  modelId: string;
  previousFactor: number;
  correctionFactor: number;
  errorRatio: number;
  counted: boolean;
  reports: string;
}

// ---------------------------------------------------------------------------------- Rotate

export interface RotateRequest {
  tenantId: string;
  sessionId: string;
  reason: EnumIn<RotationReason>;
  dropTools?: string[];
  model?: ModelSpec;
  memorySnapshot?: MemorySnapshot;
  /** Required by the service: a retried key rotates once. */
  idempotencyKey: string;
}

export interface RotateResponse {
  plan: ContextPlan;
  /** False when this key had already rotated. */
  rotated: boolean;
}

// ------------------------------------------------------------------------- working state

export interface WorkingStateUpdate {
  objective?: string;
  addConstraints?: string[];
  upsertTasks?: WorkingTask[];
  addFacts?: WorkingFact[];
  resolveQuestions?: string[];
  nextAction?: string;
  /** The label of the model output that carried the call (at most USER; unset: USER). */
  trust?: EnumIn<TrustLevel>;
}

export interface ToolOutcome {
  taskId?: string;
  outcome?: EnumIn<ToolOutcomeKind>;
}

/**
 * The model's `context.update_working_state` call exactly as the provider returned it: the
 * service parses and validates the arguments itself.
 */
export interface WorkingStateToolCall {
  callId?: string;
  /** `context.update_working_state`, or its provider form `context__update_working_state`. */
  name?: string;
  /** The arguments as the provider returned them: a JSON object text. */
  argumentsJson?: string;
  /** The label of the model output that carried the call (at most USER; unset: USER). */
  trust?: EnumIn<TrustLevel>;
}

/** Runtime: the user removed a constraint (by its exact text). No tool input can. */
export interface RemoveConstraint {
  constraint?: string;
  /** The session event of the user's message or action that removed it. */
  userEventId?: Int64;
}

/** One transition; exactly one field is set. */
export interface WorkingStateTransition {
  update?: WorkingStateUpdate;
  toolOutcome?: ToolOutcome;
  askUser?: { question?: string; trust?: EnumIn<TrustLevel> };
  answer?: { question?: string };
  userObjective?: { objective?: string; trust?: EnumIn<TrustLevel> };
  /** The model's raw call of the control tool (what most runtimes send). */
  toolCall?: WorkingStateToolCall;
  removeConstraint?: RemoveConstraint;
}

export interface UpdateWorkingStateRequest {
  tenantId: string;
  sessionId: string;
  runId?: string;
  current?: WorkingState;
  sequence?: Int64;
  transition?: WorkingStateTransition;
  estimatorFactor?: number;
}

/** A working state as the service returns it (every field present). */
export interface WorkingStateOut {
  objective: string;
  constraints: string[];
  tasks: {
    id: string;
    title: string;
    state: string;
    sequence: string;
    runId: string;
    trust: TrustLevel;
  }[];
  facts: {
    statement: string;
    sourceEventIds: string[];
    trust: TrustLevel;
    sequence: string;
    runId: string;
  }[];
  openQuestions: string[];
  nextAction: string;
  supersededObjectives: string[];
  questionOrigins: { sequence: string; runId: string; trust: TrustLevel }[];
  objectiveTrust: TrustLevel;
  constraintTrust: TrustLevel[];
  nextActionTrust: TrustLevel;
  supersededTrust: TrustLevel[];
  removedConstraints: string[];
}

export interface WorkingStateChange {
  transition: string;
  objectiveChanged: boolean;
  objectiveSuperseded: boolean;
  constraintsAdded: number;
  tasksUpserted: string[];
  tasksEvicted: string[];
  factsAdded: number;
  factsEvicted: number;
  questionsAdded: number;
  questionsResolved: number;
  questionsEvicted: number;
  nextActionChanged: boolean;
  tokens: number;
  constraintsRemoved: number;
  userEventId: string;
}

export interface UpdateWorkingStateResponse {
  state: WorkingStateOut;
  change: WorkingStateChange;
  /**
   * For a raw `toolCall`: the result to return to the model for that call (a confirmation).
   * A call with invalid arguments fails `INVALID_ARGUMENT` instead, and the error's
   * `toolResult` holds the text to return: the errors and the tool's input schema.
   */
  toolResult: string;
}

export interface WorkingStateEvent {
  sequence?: Int64;
  runId?: string;
  transition?: WorkingStateTransition;
}

export interface CarryWorkingStateRequest {
  tenantId: string;
  sessionId: string;
  seedEventSequence?: Int64;
  events?: WorkingStateEvent[];
  estimatorFactor?: number;
}

export interface CarryWorkingStateResponse {
  state: WorkingStateOut;
  eventsApplied: number;
  eventsSkipped: number;
  tokens: number;
}

// --------------------------------------------------------------------------------- Compact

export interface CompactRequest {
  tenantId: string;
  sessionId: string;
  checkpoint?: Checkpoint;
  /** Target (one of): free at least this many tokens (Build's `leftOutTokens`). */
  tokensToFree?: number;
  /** Target (one of): replace every whole unit at or below this sequence. */
  replaceThroughSequence?: Int64;
  reason?: string;
  /** Required by the service: a retried key returns the stored result. */
  idempotencyKey: string;
  maxSummaryTokens?: number;
  estimatorFactor?: number;
}

/** A summary as `Compact` returns it; assignable to {@link Summary}. */
export interface SummaryOut {
  text: string;
  replacedThroughSequence: string;
  sourceEventIds: string[];
  depth: number;
  constraints: string[];
  elided: {
    itemId: string;
    trustLevel: TrustLevel;
    byteLength: string;
    artifactRef: string;
    eventId: string;
    kind: string;
  }[];
  trust: TrustLevel;
  constraintTrust: TrustLevel[];
}

export interface CompactResponse {
  summary: SummaryOut;
  tokensBefore: number;
  tokensAfter: number;
  compactorVersion: string;
  summarizerVersion: string;
  replacedItemIds: string[];
  /** False when this key had already compacted. */
  compacted: boolean;
}
