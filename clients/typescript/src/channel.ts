/**
 * What a channel is made of: the gRPC service config that carries the retry policy, message
 * limits, credentials and call metadata. Retries are grpc-js's own, driven by the service
 * config; this client has no retry loop.
 */
import { isIPv4, isIPv6 } from "node:net";

import * as grpc from "@grpc/grpc-js";

import { RETRY_SERVICE_CONFIG } from "./gen/retry_service_config";

/** The service's full name, as service configs name it. */
export const SERVICE = "context_engine.v1.ContextEngine";

/**
 * The writes that may be retried only when the request carries an idempotency key (the
 * service then applies a retried call once). A service config names methods, not requests,
 * so these go through a second channel whose config retries them too.
 */
export const KEYED_METHODS: readonly string[] = Object.freeze(["Rotate", "Compact", "ReportUsage"]);

/** Default send and receive limit: the service's (a 1,000-item conversation is about 3 MB). */
export const DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024;

/** One `name` of a `methodConfig` entry: a method, every method of a service, or everything. */
export interface MethodName {
  service?: string;
  method?: string;
}

/** gRPC's retry policy (https://github.com/grpc/proposal/blob/master/A6-client-retries.md). */
export interface RetryPolicy {
  maxAttempts: number;
  initialBackoff: string;
  maxBackoff: string;
  backoffMultiplier: number;
  retryableStatusCodes: (string | number)[];
}

export interface MethodConfig {
  name: MethodName[];
  retryPolicy?: RetryPolicy;
  [setting: string]: unknown;
}

/** A gRPC service config as JSON (grpc/grpc `doc/service_config.md`). */
export interface ServiceConfig {
  methodConfig?: MethodConfig[];
  [setting: string]: unknown;
}

/**
 * A copy of the packaged service config: `clients/retry_service_config.json` of the repository,
 * embedded at build time. It retries `UNAVAILABLE` for Plan, GetPlan, Build, UpdateWorkingState,
 * CarryWorkingState and DeleteSession (4 attempts, backoff 0.1 s doubling up to 2 s).
 */
export function packagedServiceConfig(): ServiceConfig {
  return JSON.parse(JSON.stringify(RETRY_SERVICE_CONFIG)) as ServiceConfig;
}

/** The config's retry policy, or `undefined` when it retries nothing. */
export function retryPolicyOf(config: ServiceConfig): RetryPolicy | undefined {
  const policies = (config.methodConfig ?? []).flatMap((entry) =>
    entry.retryPolicy === undefined ? [] : [entry.retryPolicy]);
  if (policies.length > 1) {
    throw new Error("the service config must hold at most one retryPolicy: it is also the " +
      "policy of the writes that carry an idempotency key");
  }
  return policies[0];
}

function isKeyed(name: MethodName): boolean {
  return name.service === SERVICE && name.method !== undefined &&
    KEYED_METHODS.includes(name.method);
}

/** How a name covers the keyed writes without naming them: 2 for the service, 1 for every
 * service (the default), 0 not at all. */
function coversKeyed(name: MethodName): number {
  if (name.method) return 0;
  return name.service === SERVICE ? 2 : name.service ? 0 : 1;
}

/** The entry gRPC applies to the keyed writes where none names them: the most specific one
 * naming their service, or every service. */
function wideEntry(config: ServiceConfig): MethodConfig | undefined {
  let wide: [number, MethodConfig] | undefined;
  for (const entry of config.methodConfig ?? []) {
    const cover = Math.max(0, ...entry.name.map(coversKeyed));
    if (cover > 0 && (wide === undefined || cover > wide[0])) wide = [cover, entry];
  }
  return wide?.[1];
}

/**
 * The config of the channel for every other call: Rotate, Compact and ReportUsage, sent there
 * without their key, never retried nor hedged, whatever the config (a keyed write named with a
 * retry or hedging policy, or a service-wide or default entry holding one, which gRPC applies
 * to every method the config names nowhere else). Each keeps the entry's other settings.
 */
export function unkeyedServiceConfig(config: ServiceConfig): ServiceConfig {
  const methodConfig: MethodConfig[] = [];
  const named = new Set<string>();
  for (const entry of config.methodConfig ?? []) {
    const keyed = entry.name.filter(isKeyed);
    const others = entry.name.filter((n) => !isKeyed(n));
    if (others.length > 0) methodConfig.push({ ...entry, name: others });
    if (keyed.length > 0) {
      const { retryPolicy: _dropped, hedgingPolicy: _hedged, ...rest } = entry;
      methodConfig.push({ ...rest, name: keyed });
      for (const n of keyed) named.add(n.method!);
    }
  }
  const missing = KEYED_METHODS.filter((m) => !named.has(m)).sort();  // as Python's
  const wide = wideEntry(config);
  if (missing.length > 0 && wide !== undefined && (wide.retryPolicy !== undefined ||
      wide.hedgingPolicy !== undefined)) {
    const { retryPolicy: _dropped, hedgingPolicy: _hedged, ...rest } = wide;
    methodConfig.push({ ...rest, name: missing.map((method) => ({ service: SERVICE, method })) });
  }
  return { ...config, methodConfig };
}

/**
 * The config of the channel that carries keyed writes: `config` with Rotate, Compact and
 * ReportUsage under its retry policy (their other settings kept; those no entry names keep the
 * settings of the service-wide or default entry that covers them). Unchanged when `config`
 * retries nothing.
 */
export function keyedServiceConfig(config: ServiceConfig): ServiceConfig {
  const policy = retryPolicyOf(config);
  if (policy === undefined) return config;
  const methodConfig: MethodConfig[] = [];
  const named = new Set<string>();
  for (const entry of config.methodConfig ?? []) {
    const keyed = entry.name.filter(isKeyed);
    const others = entry.name.filter((n) => !isKeyed(n));
    if (others.length > 0) methodConfig.push({ ...entry, name: others });
    if (keyed.length > 0) {
      // a keyed write named with a hedging policy is hedged (its key makes that safe): gRPC
      // refuses an entry holding both policies, which failed every keyed write
      methodConfig.push(entry.hedgingPolicy !== undefined ? { ...entry, name: keyed }
        : { ...entry, name: keyed, retryPolicy: entry.retryPolicy ?? policy });
      for (const n of keyed) named.add(n.method!);
    }
  }
  const missing = KEYED_METHODS.filter((m) => !named.has(m)).sort();  // as Python's
  if (missing.length > 0) {
    // with the settings of the entry grpc-js would apply to them (a deadline, a size limit)
    const { retryPolicy: widePolicy, hedgingPolicy: _hedged, ...rest } =
      wideEntry(config) ?? { name: [] };
    methodConfig.push({ ...rest, name: missing.map((method) => ({ service: SERVICE, method })),
      retryPolicy: widePolicy ?? policy });
  }
  return { ...config, methodConfig };
}

/** Channel options: the service config (retries on), message limits and the retry buffers. */
export function channelOptions(config: ServiceConfig, maxMessageBytes: number,
                               serverName?: string): grpc.ChannelOptions {
  return {
    "grpc.service_config": JSON.stringify(config),
    "grpc.enable_retries": 1,
    "grpc.max_send_message_length": maxMessageBytes,
    "grpc.max_receive_message_length": maxMessageBytes,
    // A call is retried only while its request is still buffered; Build requests are large.
    "grpc.per_rpc_retry_buffer_size": maxMessageBytes,
    "grpc.retry_buffer_size": maxMessageBytes,
    ...(serverName ? { "grpc.ssl_target_name_override": serverName,
      "grpc.default_authority": serverName } : {}),
  };
}

/** PEM bytes for a TLS channel; `certChain` and `privateKey` together enable mutual TLS. */
export interface TlsOptions {
  /** CA certificates that sign the server's certificate; absent uses the system roots. */
  rootCerts?: Buffer;
  /** Client certificate chain, for mutual TLS. */
  certChain?: Buffer;
  /** Client private key, for mutual TLS. */
  privateKey?: Buffer;
}

/**
 * Whether every address of a gRPC target is on this machine: a Unix socket, `localhost`, or a
 * loopback IP (`127.0.0.0/8`, `::1`), with or without a `dns:`/`ipv4:`/`ipv6:` scheme.
 * Addresses are read as Node reads them: `127.999.0.1` is a name, which DNS could answer with
 * any host, and a zone id (`[::1%lo]`) is not read as loopback.
 */
export function isLoopback(target: string): boolean {
  if (/^unix(-abstract)?:/.test(target)) return true;
  const rest = target.replace(/^(dns:\/\/\/|dns:|ipv4:|ipv6:)/, "");
  return rest !== "" && rest.split(",").every((address) => {
    const host = address.startsWith("[") ? address.slice(1, address.indexOf("]"))
      : (address.match(/:/g) ?? []).length > 1 ? address : address.replace(/:[^:]*$/, "");
    return host.toLowerCase() === "localhost" || (isIPv4(host) && host.startsWith("127.")) ||
      (isIPv6(host) && !host.includes("%") && new URL(`http://[${host}]/`).hostname === "[::1]");
  });
}

/**
 * The channel options a plaintext channel carrying a token needs: to a loopback target it
 * goes straight, never through a proxy of the environment (`grpc_proxy`, `https_proxy`,
 * `http_proxy`), which would carry the token off this machine in plaintext.
 */
export function tokenTransportOptions(target: string, insecure: boolean | undefined,
                                      token: string | undefined): grpc.ChannelOptions {
  return insecure && token !== undefined && isLoopback(target)
    ? { "grpc.enable_http_proxy": 0 } : {};
}

export function channelCredentials(insecure: boolean | undefined,
                                   tls: TlsOptions | undefined): grpc.ChannelCredentials {
  if (insecure) {
    if (tls) throw new Error("tls and insecure are mutually exclusive");
    return grpc.credentials.createInsecure();
  }
  const { rootCerts, certChain, privateKey } = tls ?? {};
  if ((certChain === undefined) !== (privateKey === undefined)) {
    throw new Error("mutual TLS needs both certChain and privateKey");
  }
  return grpc.credentials.createSsl(rootCerts ?? null, privateKey ?? null, certChain ?? null);
}

/** Per-call metadata: a grpc-js `Metadata`, or a plain record of keys to values. */
export type MetadataInit =
  | grpc.Metadata
  | Record<string, string | Buffer | readonly (string | Buffer)[]>;

/** Whether `value` is a grpc-js `Metadata`, possibly of another copy of grpc-js. */
function isMetadata(value: MetadataInit): value is grpc.Metadata {
  return value instanceof grpc.Metadata ||
    (typeof (value as { getMap?: unknown }).getMap === "function" &&
     typeof (value as { toJSON?: unknown }).toJSON === "function");
}

/** HTTP/2 connection-specific headers: Node refuses a request holding one, and grpc-js then
 * drops the shared connection and retries the call until its deadline, spinning a core. */
const CONNECTION_HEADERS = new Set(["connection", "keep-alive", "proxy-connection",
  "transfer-encoding", "upgrade", "te", "host", "content-type"]);

/**
 * A call's metadata: `authorization: Bearer <token>` when there is a token, then the caller's
 * (a key the caller sends replaces the client's, `authorization` included). A key is lower-case
 * letters, digits, `_`, `.` and `-`, neither gRPC's own (`grpc-`) nor an HTTP/2
 * connection-specific header: anything else throws a `TypeError` before the call is made.
 */
export function callMetadata(token: string | undefined, extra?: MetadataInit): grpc.Metadata {
  const md = new grpc.Metadata();
  if (token !== undefined) md.set("authorization", `Bearer ${token}`);
  if (extra !== undefined) {
    const entries = isMetadata(extra) ? Object.entries(extra.toJSON()) : Object.entries(extra);
    for (const [key, value] of entries) {
      const name = key.toLowerCase();
      if (!/^[0-9a-z_.-]+$/.test(name) || name.startsWith("grpc-") ||
          CONNECTION_HEADERS.has(name)) {
        throw new TypeError(`call metadata key ${JSON.stringify(key)}: letters, digits, "_", ` +
          `"." and "-" only, neither a "grpc-" key nor an HTTP/2 connection header`);
      }
      md.remove(key);
      for (const one of Array.isArray(value) ? value : [value]) md.add(key, one as string | Buffer);
    }
  }
  return md;
}

/** A bearer token must be one non-empty line of printable ASCII (a header value grpc-js sends). */
export function checkToken(token: string | undefined): string | undefined {
  if (token !== undefined && !/^[\x20-\x7e]+$/.test(token)) {
    throw new Error("the token must be one non-empty line of printable ASCII (it is sent in " +
      "the authorization header)");
  }
  return token;
}
