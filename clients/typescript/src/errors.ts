/**
 * Typed errors: the gRPC status code plus the `google.rpc.Status` the service attaches in the
 * `grpc-status-details-bin` trailer, decoded with the types generated from
 * `proto/google/rpc/status.proto` and `error_details.proto`.
 */
import * as grpc from "@grpc/grpc-js";

import type { Any } from "./gen/google/protobuf/any";
import {
  BadRequest,
  type BadRequest_FieldViolation,
  ErrorInfo,
  LocalizedMessage,
  RetryInfo,
} from "./gen/google/rpc/error_details";
import { Status } from "./gen/google/rpc/status";

const STATUS_DETAILS_KEY = "grpc-status-details-bin";
/** Set by grpc-js on the status of a call it retried: the attempts before the last one. */
const PREVIOUS_ATTEMPTS_KEY = "grpc-previous-rpc-attempts";
const TYPE_URL_PREFIX = "type.googleapis.com/";

/** One `google.rpc.BadRequest.FieldViolation` (`field`, `description`, `reason`, ...). */
export type FieldViolation = BadRequest_FieldViolation;

/** The status code's name, e.g. `"NOT_FOUND"`. */
export function codeName(code: grpc.status): string {
  return grpc.status[code] ?? `CODE_${code}`;
}

/** What a `google.rpc.Status` says, its details decoded. */
export interface StatusDetails {
  /** The whole decoded status, for any detail not read below. */
  status: Status;
  message: string;
  /** The single `ErrorInfo`: `reason` (UPPER_SNAKE_CASE), `domain`, `metadata`. */
  errorInfo: ErrorInfo | undefined;
  /** Every `BadRequest` field violation. */
  violations: FieldViolation[];
  /** The `LocalizedMessage`: the tool result for a refused `context.update_working_state` call. */
  localizedMessage: LocalizedMessage | undefined;
  /** `RetryInfo.retry_delay` in milliseconds, when the service sent one. */
  retryDelayMs: number | undefined;
  /** Details of other types, as sent (decode them with the exported `googleRpc` types). */
  otherDetails: Any[];
}

function durationMs(duration: { seconds: string; nanos: number } | undefined): number | undefined {
  if (duration === undefined) return undefined;
  return Number(duration.seconds) * 1_000 + duration.nanos / 1_000_000;
}

/** Decodes `grpc-status-details-bin` (a serialized `google.rpc.Status`). */
export function parseStatusDetails(bin: Uint8Array): StatusDetails {
  const status = Status.decode(bin);
  const out: StatusDetails = { status, message: status.message, errorInfo: undefined,
    violations: [], localizedMessage: undefined, retryDelayMs: undefined, otherDetails: [] };
  for (const detail of status.details) {
    const type = detail.typeUrl.startsWith(TYPE_URL_PREFIX)
      ? detail.typeUrl.slice(TYPE_URL_PREFIX.length) : detail.typeUrl;
    if (type === "google.rpc.ErrorInfo" && out.errorInfo === undefined) {
      out.errorInfo = ErrorInfo.decode(detail.value);
    } else if (type === "google.rpc.BadRequest") {
      out.violations.push(...BadRequest.decode(detail.value).fieldViolations);
    } else if (type === "google.rpc.LocalizedMessage" && out.localizedMessage === undefined) {
      out.localizedMessage = LocalizedMessage.decode(detail.value);
    } else if (type === "google.rpc.RetryInfo" && out.retryDelayMs === undefined) {
      out.retryDelayMs = durationMs(RetryInfo.decode(detail.value).retryDelay);
    } else {
      out.otherDetails.push(detail);
    }
  }
  return out;
}

/**
 * A failed call. `code` is the gRPC status code (compare with `GrpcStatus.NOT_FOUND`, or read
 * `codeName`); `reason`, `domain` and `metadata` come from the status's single `ErrorInfo`
 * (empty when the failure happened before the service answered, e.g. a missed deadline, or
 * when the status's code or message is not the call's);
 * `violations` lists `BadRequest` field violations for malformed input; `toolResult` is the
 * status's `LocalizedMessage`: for a refused `context.update_working_state` call, the text to
 * return to the model as that call's result (what was wrong, and the tool's input schema).
 */
export class ContextEngineError extends Error {
  override readonly name = "ContextEngineError";
  readonly code: grpc.status;
  readonly codeName: string;
  /** The status message (`google.rpc.Status.message`, or the gRPC details string). */
  readonly details: string;
  readonly reason: string;
  readonly domain: string;
  readonly metadata: Readonly<Record<string, string>>;
  readonly violations: readonly FieldViolation[];
  /** The tool result for the model when its own tool call was refused; `""` otherwise. */
  readonly toolResult: string;
  /** How long the service asks to wait before trying again (`RetryInfo`), if it said. */
  readonly retryDelayMs: number | undefined;
  /** The decoded `google.rpc.Status`, when the service sent one. */
  readonly status: Status | undefined;
  /** Status details of types not read into the fields above. */
  readonly otherDetails: readonly Any[];
  /** The RPC that failed, e.g. `"Build"`. */
  readonly method: string;
  /** How many attempts grpc-js made (more than 1 after retries of `UNAVAILABLE`), as the
   * status's trailer says: a deadline or cancellation grpc-js reports itself has none (1; its
   * `details` say `previous attempts: N`). */
  readonly attempts: number;
  /** The trailing metadata of the failed call. */
  readonly trailers: grpc.Metadata;

  constructor(init: {
    code: grpc.status;
    details: string;
    method: string;
    parsed?: StatusDetails;
    attempts?: number;
    trailers?: grpc.Metadata;
    cause?: unknown;
  }) {
    const info = init.parsed?.errorInfo;
    const reason = info?.reason ?? "";
    // a reason that is the code's own name (malformed input's) is not said twice
    const said = reason && reason !== codeName(init.code) ? ` ${reason}` : "";
    super(`${init.method}: ${codeName(init.code)}${said}: ${init.details}`,
      init.cause === undefined ? undefined : { cause: init.cause });
    this.code = init.code;
    this.codeName = codeName(init.code);
    this.details = init.details;
    this.method = init.method;
    this.reason = reason;
    this.domain = info?.domain ?? "";
    this.metadata = Object.freeze({ ...(info?.metadata ?? {}) });
    this.violations = Object.freeze([...(init.parsed?.violations ?? [])]);
    this.toolResult = init.parsed?.localizedMessage?.message ?? "";
    this.retryDelayMs = init.parsed?.retryDelayMs;
    this.status = init.parsed?.status;
    this.otherDetails = Object.freeze([...(init.parsed?.otherDetails ?? [])]);
    this.attempts = init.attempts ?? 1;
    this.trailers = init.trailers ?? new grpc.Metadata();
  }
}

/** How many attempts grpc-js made, from the status it reports. */
function attemptsOf(metadata: grpc.Metadata | undefined): number {
  const previous = Number(metadata?.get(PREVIOUS_ATTEMPTS_KEY)[0] ?? 0);
  return Number.isInteger(previous) && previous > 0 ? previous + 1 : 1;
}

/**
 * Turns a grpc-js `ServiceError` into a {@link ContextEngineError}. A `grpc-status-details-bin`
 * trailer that is not a `google.rpc.Status`, or one whose code or message is not the call's, is
 * not read: the error has the call's own code and message, and no reason or details.
 */
export function fromServiceError(err: grpc.ServiceError, method: string): ContextEngineError {
  const trailers = err.metadata ?? new grpc.Metadata();
  const common = { code: err.code, method, attempts: attemptsOf(trailers), trailers };
  const first = trailers.get(STATUS_DETAILS_KEY)[0];
  if (first !== undefined && typeof first !== "string") {
    try {
      const parsed = parseStatusDetails(first);
      if (parsed.status.code !== err.code || parsed.status.message !== err.details) {
        // A status whose code or message contradicts the call's (an intermediary rewrote one
        // of them): its reason and details describe another failure, so none is read (grpc's
        // own libraries refuse such a status too, the Python client with them); the call's
        // code and message stand.
        return new ContextEngineError({ ...common, details: err.details, cause: err });
      }
      return new ContextEngineError({ ...common, details: parsed.message || err.details, parsed,
        cause: err });
    } catch (decodeError) {
      // A trailer that is not a google.rpc.Status: keep the status code, drop the details.
      return new ContextEngineError({ ...common, details: err.details, cause: decodeError });
    }
  }
  return new ContextEngineError({ ...common, details: err.details, cause: err });
}
