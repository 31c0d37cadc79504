/**
 * `@context-engine/client`: a typed Node.js client of `context_engine.v1.ContextEngine`.
 * Message types, enums and the grpc-js service definition are generated from the contract at
 * build time (ts-proto); the client adds deadlines, credentials, per-call metadata, typed
 * errors, the packaged retry service config and incremental Build (`build()` sends only what
 * changed since the session's previous Build); `formats` parses the provider body a
 * `BuildResponse` carries (`providerBody`, `chatCompletionsBody`, `geminiBody`, ...).
 */
export { ContextEngineClient, MAX_WAIT_MS } from "./client";
export type { CallOptions, ClientOptions, IncrementalOptions, Input } from "./client";
export {
  BUILD_BASE_UNKNOWN,
  DEFAULT_MAX_SESSIONS,
  DeltaMismatchError,
  IncrementalBuilds,
} from "./incremental";
export type { Absorbed, BuildStats, Prepared } from "./incremental";
export {
  DEFAULT_MAX_MESSAGE_BYTES,
  KEYED_METHODS,
  SERVICE,
  isLoopback,
  keyedServiceConfig,
  packagedServiceConfig,
  retryPolicyOf,
  tokenTransportOptions,
  unkeyedServiceConfig,
} from "./channel";
export type {
  MetadataInit,
  MethodConfig,
  MethodName,
  RetryPolicy,
  ServiceConfig,
  TlsOptions,
} from "./channel";
export { ContextEngineError, codeName, parseStatusDetails } from "./errors";
export type { FieldViolation, StatusDetails } from "./errors";
export {
  FORMAT_NAMES,
  GeminiCachedContentBodies,
  ProviderBodyError,
  anthropicMessagesBody,
  bedrockConverseBody,
  bodyOf,
  chatCompletionsBody,
  geminiBody,
  geminiCachedContent,
  openaiResponsesBody,
  parseProviderFormat,
  providerBody,
  providerFormatName,
} from "./formats";
export type {
  AnthropicMessagesBody,
  BedrockConverseBody,
  BodyCarrier,
  BodyFormat,
  ChatCompletionsBody,
  FormatName,
  GeminiGenerateContentBody,
  JsonObject,
  JsonValue,
  OpenAIResponsesBody,
  ProviderBodies,
} from "./formats";
export { PACKAGE_ROOT, PROTO_DIR } from "./paths";
// Every message type (an interface and a value with encode/decode/fromJSON/toJSON/fromPartial),
// every enum, and ContextEngineService, the grpc-js service definition.
export * from "./gen/context_engine/v1/context_engine";
export * as googleRpc from "./google_rpc";
export { Metadata, status as GrpcStatus } from "@grpc/grpc-js";
