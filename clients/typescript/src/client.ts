/** A typed client of `context_engine.v1.ContextEngine` over `@grpc/grpc-js`. */
import * as grpc from "@grpc/grpc-js";

import {
  DEFAULT_MAX_MESSAGE_BYTES,
  KEYED_METHODS,
  type MetadataInit,
  type ServiceConfig,
  type TlsOptions,
  callMetadata,
  channelCredentials,
  channelOptions,
  checkToken,
  keyedServiceConfig,
  packagedServiceConfig,
} from "./channel";
import { ContextEngineError, fromServiceError } from "./errors";
import {
  BuildRequest,
  type BuildResponse,
  CarryWorkingStateRequest,
  type CarryWorkingStateResponse,
  CompactRequest,
  type CompactResponse,
  ContextEngineService,
  type DeepPartial,
  DeleteSessionRequest,
  type DeleteSessionResponse,
  GetPlanRequest,
  type GetPlanResponse,
  PlanRequest,
  type PlanResponse,
  ReportUsageRequest,
  type ReportUsageResponse,
  RotateRequest,
  type RotateResponse,
  UpdateWorkingStateRequest,
  type UpdateWorkingStateResponse,
} from "./gen/context_engine/v1/context_engine";

export interface ClientOptions {
  /** `host:port` of the service (any grpc-js target, e.g. `dns:ce.internal:443`). */
  target: string;
  /** Bearer token sent as `authorization: Bearer <token>` on every call. */
  token?: string;
  /** TLS settings. Without `tls` and without `insecure`, TLS with the system roots is used. */
  tls?: TlsOptions;
  /** Check the server's certificate against this name instead of the target's host. */
  serverName?: string;
  /** Plaintext channel (local development; the service allows it only on loopback). */
  insecure?: boolean;
  /** Deadline of every call, retries included, unless the call passes its own (default 10 s). */
  deadlineMs?: number;
  /** Send and receive limit (default 64 MiB, the service's default receive limit). */
  maxMessageBytes?: number;
  /**
   * A gRPC service config (JSON text or object) replacing the packaged one
   * (`clients/retry_service_config.json`); its retry policy also retries keyed writes.
   */
  serviceConfig?: string | ServiceConfig;
  /** Extra grpc-js channel options (applied last). */
  channelOptions?: grpc.ChannelOptions;
}

export interface CallOptions {
  /** Deadline of this call, retries included, in milliseconds from now. */
  deadlineMs?: number;
  /**
   * Request metadata for this call (trace context, request ids): a grpc-js `Metadata` or a
   * plain record; binary values go under keys ending in `-bin`.
   */
  metadata?: MetadataInit;
  /** Cancels the call (it then fails with `CANCELLED`). */
  signal?: AbortSignal;
}

/** A request as the methods take it: any subset of the message's fields, nested likewise. */
export type Input<T> = DeepPartial<T>;

const DEFAULT_DEADLINE_MS = 10_000;

/** What the client needs of a generated message: fill in the defaults of a partial one. */
interface Fills<T> {
  fromPartial(object: DeepPartial<T>): T;
}

/**
 * The context-engine client. One instance holds its channel; share it and `close()` it at
 * shutdown. Every method resolves to the typed response or rejects with a
 * {@link ContextEngineError}.
 *
 * `UNAVAILABLE` is retried by grpc-js, as the channel's service config says (by default the
 * packaged `retry_service_config.json`): always for Plan, GetPlan, Build, UpdateWorkingState,
 * CarryWorkingState and DeleteSession; for Rotate, Compact and ReportUsage only when the request
 * carries an `idempotencyKey`, through a second channel (opened on first use) whose config adds
 * them.
 */
export class ContextEngineClient {
  readonly target: string;
  private readonly channel: grpc.Client;
  private keyedChannel: grpc.Client | undefined;
  private readonly openKeyed: () => grpc.Client;
  private readonly token: string | undefined;
  private readonly deadlineMs: number;

  constructor(options: ClientOptions) {
    this.token = checkToken(options.token);
    this.deadlineMs = options.deadlineMs ?? DEFAULT_DEADLINE_MS;
    if (!(this.deadlineMs > 0)) {
      throw new Error(`deadlineMs must be positive, got ${this.deadlineMs}`);
    }
    const credentials = channelCredentials(options.insecure, options.tls);
    const limit = options.maxMessageBytes ?? DEFAULT_MAX_MESSAGE_BYTES;
    const config = typeof options.serviceConfig === "string"
      ? JSON.parse(options.serviceConfig) as ServiceConfig
      : options.serviceConfig ?? packagedServiceConfig();
    const keyedConfig = keyedServiceConfig(config);
    const open = (c: ServiceConfig): grpc.Client => new grpc.Client(options.target, credentials,
      { ...channelOptions(c, limit, options.serverName), ...options.channelOptions });
    this.target = options.target;
    this.channel = open(config);
    this.openKeyed = () => open(keyedConfig);
  }

  /** Resolves the session's plan, creating epoch 1 or rotating when a pinned input changed. */
  plan(request: Input<PlanRequest>, options?: CallOptions): Promise<PlanResponse> {
    return this.call(ContextEngineService.plan, PlanRequest, request, options);
  }

  /** The current (`epoch` 0) or a given epoch's plan. Read-only. */
  getPlan(request: Input<GetPlanRequest>, options?: CallOptions): Promise<GetPlanResponse> {
    return this.call(ContextEngineService.getPlan, GetPlanRequest, request, options);
  }

  /** One model request from the pinned plan and the checkpoint. Pure. */
  build(request: Input<BuildRequest>, options?: CallOptions): Promise<BuildResponse> {
    return this.call(ContextEngineService.build, BuildRequest, request, options);
  }

  /** An explicit new epoch; retried on `UNAVAILABLE` only with an idempotency key. */
  rotate(request: Input<RotateRequest>, options?: CallOptions): Promise<RotateResponse> {
    return this.call(ContextEngineService.rotate, RotateRequest, request, options);
  }

  /** Reports a sent request's actual usage; retried only with an idempotency key. */
  reportUsage(request: Input<ReportUsageRequest>,
              options?: CallOptions): Promise<ReportUsageResponse> {
    return this.call(ContextEngineService.reportUsage, ReportUsageRequest, request, options);
  }

  /**
   * Applies one working-state transition. Pure. Send the model's `context.update_working_state`
   * call as the provider returned it (`transition.toolCall`) and return the response's
   * `toolResult` to the model; a refused call rejects with a {@link ContextEngineError} whose
   * `toolResult` is the text to return instead.
   */
  updateWorkingState(request: Input<UpdateWorkingStateRequest>,
                     options?: CallOptions): Promise<UpdateWorkingStateResponse> {
    return this.call(ContextEngineService.updateWorkingState, UpdateWorkingStateRequest, request,
      options);
  }

  /** The next run's working state from the log's events below the seed sequence. Pure. */
  carryWorkingState(request: Input<CarryWorkingStateRequest>,
                    options?: CallOptions): Promise<CarryWorkingStateResponse> {
    return this.call(ContextEngineService.carryWorkingState, CarryWorkingStateRequest, request,
      options);
  }

  /** Compacts the oldest carried history into a summary; retried only with a key. */
  compact(request: Input<CompactRequest>, options?: CallOptions): Promise<CompactResponse> {
    return this.call(ContextEngineService.compact, CompactRequest, request, options);
  }

  /**
   * Erases a session: its plans, events, compactions, usage rows and idempotency keys (audited,
   * no content kept). Idempotent (`deleted` is false when there was nothing to erase), so it is
   * retried; replicas stop serving it from their plan caches within `planCacheSeconds`.
   */
  deleteSession(request: Input<DeleteSessionRequest>,
                options?: CallOptions): Promise<DeleteSessionResponse> {
    return this.call(ContextEngineService.deleteSession, DeleteSessionRequest, request, options);
  }

  /** Waits until the channel is connected, or rejects when the deadline passes. */
  waitForReady(deadlineMs = this.deadlineMs): Promise<void> {
    return new Promise((resolve, reject) => {
      this.channel.waitForReady(Date.now() + deadlineMs, (err) => (err ? reject(err) : resolve()));
    });
  }

  /** Closes the channels; calls in flight fail with `CANCELLED`. */
  close(): void {
    this.channel.close();
    this.keyedChannel?.close();
  }

  private channelFor(method: string, request: { idempotencyKey?: string }): grpc.Client {
    if (!KEYED_METHODS.includes(method) || !request.idempotencyKey) return this.channel;
    this.keyedChannel ??= this.openKeyed();
    return this.keyedChannel;
  }

  private call<Req, Res>(definition: grpc.MethodDefinition<Req, Res>, type: Fills<Req>,
                         input: DeepPartial<Req>, options: CallOptions = {}): Promise<Res> {
    const method = definition.path.slice(definition.path.lastIndexOf("/") + 1);
    return new Promise<Res>((resolve, reject) => {
      const { signal } = options;
      if (signal?.aborted) {
        reject(new ContextEngineError({ code: grpc.status.CANCELLED, method,
          details: "cancelled before the call", cause: signal.reason }));
        return;
      }
      let call: grpc.ClientUnaryCall;
      const cancel = (): void => call.cancel();
      try {
        const request = type.fromPartial(input);
        const deadline = Date.now() + (options.deadlineMs ?? this.deadlineMs);
        call = this.channelFor(method, request as { idempotencyKey?: string }).makeUnaryRequest(
          definition.path, definition.requestSerialize, definition.responseDeserialize, request,
          callMetadata(this.token, options.metadata), { deadline },
          (err: grpc.ServiceError | null, value?: Res) => {
            signal?.removeEventListener("abort", cancel);
            if (err) reject(fromServiceError(err, method));
            else resolve(value as Res);
          });
      } catch (err) {
        // A request that cannot be encoded, or metadata grpc-js refuses: nothing was sent.
        reject(err);
        return;
      }
      signal?.addEventListener("abort", cancel, { once: true });
    });
  }
}
