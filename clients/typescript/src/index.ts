export { ContextEngineClient, isRetryable } from "./client";
export type { CallOptions, ClientOptions, RetryOptions, TlsOptions } from "./client";
export { ContextEngineError, codeName, parseStatusDetails } from "./errors";
export type { FieldViolation, OtherDetail } from "./errors";
export { GOOGLE_RPC_PROTO_DIR, LOADER_OPTIONS, PACKAGE_ROOT, loadPackageDefinition,
  resolveProtoDir } from "./proto";
export * from "./types";
export { status as GrpcStatus } from "@grpc/grpc-js";
