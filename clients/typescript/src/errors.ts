/** Typed errors: gRPC status code plus the `google.rpc` details the service attaches. */
import * as grpc from "@grpc/grpc-js";

import { googleRpcRoot } from "./proto";

const ERROR_INFO_URL = "type.googleapis.com/google.rpc.ErrorInfo";
const BAD_REQUEST_URL = "type.googleapis.com/google.rpc.BadRequest";
const LOCALIZED_MESSAGE_URL = "type.googleapis.com/google.rpc.LocalizedMessage";
const STATUS_DETAILS_KEY = "grpc-status-details-bin";

/** One `google.rpc.BadRequest.FieldViolation`. */
export interface FieldViolation {
  field: string;
  description: string;
  reason: string;
}

/** A `google.protobuf.Any` detail this client does not interpret. */
export interface OtherDetail {
  typeUrl: string;
  value: Buffer;
}

/** The status code's name, e.g. `"NOT_FOUND"`. */
export function codeName(code: grpc.status): string {
  return grpc.status[code] ?? `CODE_${code}`;
}

/**
 * A failed call. `code` is the gRPC status code (compare with `grpc.status.NOT_FOUND` or use
 * `codeName`); `reason`, `domain` and `metadata` come from the status's single `ErrorInfo`
 * (empty when the failure happened before the service answered, e.g. a missed deadline);
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
  readonly otherDetails: readonly OtherDetail[];
  /** The RPC that failed, e.g. `"Build"`. */
  readonly method: string;
  /** How many attempts were made (more than 1 after retries of `UNAVAILABLE`). */
  readonly attempts: number;

  constructor(init: {
    code: grpc.status;
    details: string;
    method: string;
    reason?: string;
    domain?: string;
    metadata?: Record<string, string>;
    violations?: FieldViolation[];
    toolResult?: string;
    otherDetails?: OtherDetail[];
    attempts?: number;
    cause?: unknown;
  }) {
    const reason = init.reason ?? "";
    super(`${init.method}: ${codeName(init.code)}${reason ? ` ${reason}` : ""}: ${init.details}`,
      init.cause === undefined ? undefined : { cause: init.cause });
    this.code = init.code;
    this.codeName = codeName(init.code);
    this.details = init.details;
    this.method = init.method;
    this.reason = reason;
    this.domain = init.domain ?? "";
    this.metadata = Object.freeze({ ...(init.metadata ?? {}) });
    this.violations = Object.freeze([...(init.violations ?? [])]);
    this.toolResult = init.toolResult ?? "";
    this.otherDetails = Object.freeze([...(init.otherDetails ?? [])]);
    this.attempts = init.attempts ?? 1;
  }
}

/** protobufjs's bundled `google.protobuf.Any` keeps the proto's field name `type_url`. */
interface DecodedAny {
  type_url?: string;
  typeUrl?: string;
  value: Uint8Array;
}

/** Decodes `grpc-status-details-bin` (a serialized `google.rpc.Status`) into its parts. */
export function parseStatusDetails(bin: Buffer): {
  message: string;
  reason: string;
  domain: string;
  metadata: Record<string, string>;
  violations: FieldViolation[];
  toolResult: string;
  otherDetails: OtherDetail[];
} {
  const root = googleRpcRoot();
  const Status = root.lookupType("google.rpc.Status");
  const ErrorInfo = root.lookupType("google.rpc.ErrorInfo");
  const BadRequest = root.lookupType("google.rpc.BadRequest");
  const LocalizedMessage = root.lookupType("google.rpc.LocalizedMessage");
  const status = Status.toObject(Status.decode(bin), { defaults: true }) as {
    message: string;
    details: DecodedAny[];
  };
  const out = {
    message: status.message,
    reason: "",
    domain: "",
    metadata: {} as Record<string, string>,
    violations: [] as FieldViolation[],
    toolResult: "",
    otherDetails: [] as OtherDetail[],
  };
  let seenInfo = false;
  for (const detail of status.details) {
    const typeUrl = detail.type_url ?? detail.typeUrl ?? "";
    if (typeUrl === ERROR_INFO_URL && !seenInfo) {
      const info = ErrorInfo.toObject(ErrorInfo.decode(detail.value), { defaults: true }) as {
        reason: string;
        domain: string;
        metadata: Record<string, string>;
      };
      out.reason = info.reason;
      out.domain = info.domain;
      out.metadata = { ...info.metadata };
      seenInfo = true;
    } else if (typeUrl === BAD_REQUEST_URL) {
      const bad = BadRequest.toObject(BadRequest.decode(detail.value), { defaults: true }) as {
        fieldViolations: FieldViolation[];
      };
      for (const v of bad.fieldViolations) {
        out.violations.push({ field: v.field, description: v.description, reason: v.reason ?? "" });
      }
    } else if (typeUrl === LOCALIZED_MESSAGE_URL && !out.toolResult) {
      const text = LocalizedMessage.toObject(LocalizedMessage.decode(detail.value),
        { defaults: true }) as { locale: string; message: string };
      out.toolResult = text.message;
    } else {
      out.otherDetails.push({ typeUrl, value: Buffer.from(detail.value) });
    }
  }
  return out;
}

/** Turns a grpc-js `ServiceError` into a {@link ContextEngineError}. */
export function fromServiceError(err: grpc.ServiceError, method: string,
                                 attempts = 1): ContextEngineError {
  const raw = err.metadata?.get(STATUS_DETAILS_KEY) ?? [];
  const first = raw[0];
  if (first !== undefined && typeof first !== "string") {
    try {
      const parsed = parseStatusDetails(first);
      return new ContextEngineError({
        code: err.code,
        details: parsed.message || err.details,
        method,
        reason: parsed.reason,
        domain: parsed.domain,
        metadata: parsed.metadata,
        violations: parsed.violations,
        toolResult: parsed.toolResult,
        otherDetails: parsed.otherDetails,
        attempts,
        cause: err,
      });
    } catch (decodeError) {
      // A trailer that is not a google.rpc.Status: keep the status code, drop the details.
      return new ContextEngineError({ code: err.code, details: err.details, method, attempts,
        cause: decodeError });
    }
  }
  return new ContextEngineError({ code: err.code, details: err.details, method, attempts,
    cause: err });
}
