/** A typed client of `context_engine.v1.ContextEngine` over `@grpc/grpc-js`. */
import * as grpc from "@grpc/grpc-js";

import { ContextEngineError, fromServiceError } from "./errors";
import { loadServiceConstructor, resolveProtoDir } from "./proto";
import type {
  BuildRequest,
  BuildResponse,
  CarryWorkingStateRequest,
  CarryWorkingStateResponse,
  CompactRequest,
  CompactResponse,
  GetPlanRequest,
  GetPlanResponse,
  PlanRequest,
  PlanResponse,
  ReportUsageRequest,
  ReportUsageResponse,
  RotateRequest,
  RotateResponse,
  UpdateWorkingStateRequest,
  UpdateWorkingStateResponse,
} from "./types";

/** PEM bytes for a TLS channel; `certChain` and `privateKey` together enable mutual TLS. */
export interface TlsOptions {
  /** CA certificates that sign the server's certificate; absent uses the system roots. */
  rootCerts?: Buffer;
  /** Client certificate chain, for mutual TLS. */
  certChain?: Buffer;
  /** Client private key, for mutual TLS. */
  privateKey?: Buffer;
}

/** Retries of `UNAVAILABLE` on the calls that are safe to repeat. */
export interface RetryOptions {
  /** Attempts in all, the first included (default 4; 1 disables retries). */
  maxAttempts?: number;
  /** Backoff before the second attempt (default 100 ms); doubles each time. */
  initialBackoffMs?: number;
  /** Ceiling of one backoff (default 2,000 ms). */
  maxBackoffMs?: number;
  /** Backoff growth per attempt (default 2). */
  multiplier?: number;
}

export interface ClientOptions {
  /** `host:port` of the service (any grpc-js target, e.g. `dns:ce.internal:443`). */
  target: string;
  /** Bearer token sent as `authorization: Bearer <token>` on every call. */
  token?: string;
  /** TLS settings. Without `tls` and without `insecure`, TLS with the system roots is used. */
  tls?: TlsOptions;
  /** Plaintext channel (local development; the service allows it only on loopback). */
  insecure?: boolean;
  /** Deadline of every call, retries included, unless the call passes its own (default 10 s). */
  deadlineMs?: number;
  retry?: RetryOptions;
  /** Send and receive limit (default 64 MiB, the service's default receive limit). */
  maxMessageBytes?: number;
  /** Directory holding `context_engine/v1/context_engine.proto` (default: the repo's proto/). */
  protoDir?: string;
  /** Extra grpc-js channel options. */
  channelOptions?: grpc.ChannelOptions;
}

export interface CallOptions {
  /** Deadline of this call, retries included, in milliseconds from now. */
  deadlineMs?: number;
  /** Extra request metadata. */
  metadata?: Record<string, string>;
  /** Cancels the call (it then fails with `CANCELLED`). */
  signal?: AbortSignal;
}

const DEFAULT_DEADLINE_MS = 10_000;
const DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024;

type Retryable = "always" | "with_key" | "never";

const RETRYABLE: Record<string, Retryable> = {
  Plan: "always",
  GetPlan: "always",
  Build: "always",
  UpdateWorkingState: "always",
  CarryWorkingState: "always",
  Rotate: "with_key",
  Compact: "with_key",
  ReportUsage: "with_key",
};

/** Whether a failed attempt of `method` with `request` may be sent again. */
export function isRetryable(method: string, request: { idempotencyKey?: string },
                            code: grpc.status): boolean {
  if (code !== grpc.status.UNAVAILABLE) return false;
  const rule = RETRYABLE[method] ?? "never";
  if (rule === "always") return true;
  return rule === "with_key" && typeof request.idempotencyKey === "string" &&
    request.idempotencyKey.length > 0;
}

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const timer = setTimeout(done, ms);
    function done(): void {
      clearTimeout(timer);
      signal?.removeEventListener("abort", done);
      resolve();
    }
    signal?.addEventListener("abort", done, { once: true });
  });
}

/**
 * The context-engine client. One instance holds one channel; share it and `close()` it at
 * shutdown. Every method resolves to the typed response or rejects with a
 * {@link ContextEngineError}.
 */
export class ContextEngineClient {
  private readonly client: grpc.Client;
  private readonly service: grpc.ServiceDefinition;
  private readonly token: string | undefined;
  private readonly deadlineMs: number;
  private readonly retry: Required<RetryOptions>;

  constructor(options: ClientOptions) {
    const ctor = loadServiceConstructor(resolveProtoDir(options.protoDir));
    const limit = options.maxMessageBytes ?? DEFAULT_MAX_MESSAGE_BYTES;
    let credentials: grpc.ChannelCredentials;
    if (options.insecure) {
      if (options.tls) throw new Error("tls and insecure are mutually exclusive");
      credentials = grpc.credentials.createInsecure();
    } else {
      const tls = options.tls ?? {};
      if ((tls.certChain === undefined) !== (tls.privateKey === undefined)) {
        throw new Error("mutual TLS needs both certChain and privateKey");
      }
      credentials = grpc.credentials.createSsl(tls.rootCerts ?? null, tls.privateKey ?? null,
        tls.certChain ?? null);
    }
    this.client = new ctor(options.target, credentials, {
      "grpc.max_send_message_length": limit,
      "grpc.max_receive_message_length": limit,
      ...options.channelOptions,
    });
    this.service = ctor.service;
    this.token = options.token;
    this.deadlineMs = options.deadlineMs ?? DEFAULT_DEADLINE_MS;
    this.retry = {
      maxAttempts: Math.max(1, options.retry?.maxAttempts ?? 4),
      initialBackoffMs: options.retry?.initialBackoffMs ?? 100,
      maxBackoffMs: options.retry?.maxBackoffMs ?? 2_000,
      multiplier: options.retry?.multiplier ?? 2,
    };
  }

  /** Resolves the session's plan, creating epoch 1 or rotating when a pinned input changed. */
  plan(request: PlanRequest, options?: CallOptions): Promise<PlanResponse> {
    return this.call("Plan", request, options);
  }

  /** The current (or a given) epoch's plan. */
  getPlan(request: GetPlanRequest, options?: CallOptions): Promise<GetPlanResponse> {
    return this.call("GetPlan", request, options);
  }

  /** One model request from the pinned plan and the checkpoint. Pure. */
  build(request: BuildRequest, options?: CallOptions): Promise<BuildResponse> {
    return this.call("Build", request, options);
  }

  /** An explicit new epoch; retried on `UNAVAILABLE` only with an idempotency key. */
  rotate(request: RotateRequest, options?: CallOptions): Promise<RotateResponse> {
    return this.call("Rotate", request, options);
  }

  /** Reports a sent request's actual usage; retried only with an idempotency key. */
  reportUsage(request: ReportUsageRequest, options?: CallOptions): Promise<ReportUsageResponse> {
    return this.call("ReportUsage", request, options);
  }

  /** Applies one working-state transition. Pure. */
  updateWorkingState(request: UpdateWorkingStateRequest,
                     options?: CallOptions): Promise<UpdateWorkingStateResponse> {
    return this.call("UpdateWorkingState", request, options);
  }

  /** The next run's working state from the log's events below the seed sequence. Pure. */
  carryWorkingState(request: CarryWorkingStateRequest,
                    options?: CallOptions): Promise<CarryWorkingStateResponse> {
    return this.call("CarryWorkingState", request, options);
  }

  /** Compacts the oldest carried history into a summary; retried only with a key. */
  compact(request: CompactRequest, options?: CallOptions): Promise<CompactResponse> {
    return this.call("Compact", request, options);
  }

  /** Waits until the channel is connected, or rejects when the deadline passes. */
  waitForReady(deadlineMs = this.deadlineMs): Promise<void> {
    return new Promise((resolve, reject) => {
      this.client.waitForReady(Date.now() + deadlineMs, (err) => (err ? reject(err) : resolve()));
    });
  }

  /** Closes the channel; calls in flight fail with `CANCELLED`. */
  close(): void {
    this.client.close();
  }

  private metadata(extra?: Record<string, string>): grpc.Metadata {
    const md = new grpc.Metadata();
    if (this.token !== undefined) md.set("authorization", `Bearer ${this.token}`);
    for (const [key, value] of Object.entries(extra ?? {})) md.set(key, value);
    return md;
  }

  private async call<Req extends object, Res>(method: string, request: Req,
                                             options: CallOptions = {}): Promise<Res> {
    const definition = this.service[method];
    if (definition === undefined) throw new Error(`the contract has no RPC ${method}`);
    const deadline = Date.now() + (options.deadlineMs ?? this.deadlineMs);
    let backoff = this.retry.initialBackoffMs;
    for (let attempt = 1; ; attempt++) {
      try {
        return await this.attempt<Req, Res>(definition, request, deadline, options);
      } catch (caught) {
        const err = caught as grpc.ServiceError;
        if (typeof err?.code !== "number") throw caught;
        const wait = Math.min(backoff, this.retry.maxBackoffMs) * (0.5 + Math.random() / 2);
        const again = attempt < this.retry.maxAttempts &&
          isRetryable(method, request as { idempotencyKey?: string }, err.code) &&
          !options.signal?.aborted && Date.now() + wait < deadline;
        if (!again) throw fromServiceError(err, method, attempt);
        await sleep(wait, options.signal);
        backoff *= this.retry.multiplier;
      }
    }
  }

  private attempt<Req, Res>(definition: grpc.MethodDefinition<object, object>, request: Req,
                            deadline: number, options: CallOptions): Promise<Res> {
    return new Promise<Res>((resolve, reject) => {
      if (options.signal?.aborted) {
        reject(Object.assign(new Error("cancelled before the call"), {
          code: grpc.status.CANCELLED, details: "cancelled before the call",
          metadata: new grpc.Metadata() }));
        return;
      }
      const call = this.client.makeUnaryRequest<object, object>(
        definition.path,
        definition.requestSerialize,
        definition.responseDeserialize,
        request as object,
        this.metadata(options.metadata),
        { deadline },
        (err, value) => {
          options.signal?.removeEventListener("abort", cancel);
          if (err) reject(err);
          else resolve(value as Res);
        },
      );
      function cancel(): void {
        call.cancel();
      }
      options.signal?.addEventListener("abort", cancel, { once: true });
    });
  }
}

export { ContextEngineError };
