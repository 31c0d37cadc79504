/**
 * Loads the contract at run time with `@grpc/proto-loader` (no generated code), and the
 * `google.rpc` error model with protobufjs to read `grpc-status-details-bin`.
 */
import * as fs from "node:fs";
import * as path from "node:path";

import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import * as protobuf from "protobufjs";

/** The package root (`clients/typescript`): compiled files live in `dist/src/`. */
export const PACKAGE_ROOT = path.resolve(__dirname, "..", "..");

/** `google/rpc/status.proto` and `error_details.proto`, shipped with this package. */
export const GOOGLE_RPC_PROTO_DIR = path.join(PACKAGE_ROOT, "proto");

const SERVICE_PROTO = path.join("context_engine", "v1", "context_engine.proto");

/**
 * The directory holding `context_engine/v1/context_engine.proto`: `protoDir` when given, else
 * `CE_PROTO_DIR`, else the repository's `proto/` beside `clients/`.
 */
export function resolveProtoDir(protoDir?: string): string {
  const dir = protoDir ?? process.env.CE_PROTO_DIR ?? path.resolve(PACKAGE_ROOT, "..", "..", "proto");
  if (!fs.existsSync(path.join(dir, SERVICE_PROTO))) {
    throw new Error(`context-engine contract not found: ${path.join(dir, SERVICE_PROTO)} ` +
      "(pass protoDir or set CE_PROTO_DIR)");
  }
  return dir;
}

/**
 * Options shared by every load: camelCase field names, enums as names, 64-bit integers as
 * decimal strings, defaults filled in responses, the set member of a oneof named.
 */
export const LOADER_OPTIONS: protoLoader.Options = {
  keepCase: false,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
};

const serviceCache = new Map<string, grpc.ServiceClientConstructor>();

/** The `ContextEngine` client constructor for the contract under `protoDir`. */
export function loadServiceConstructor(protoDir: string): grpc.ServiceClientConstructor {
  const cached = serviceCache.get(protoDir);
  if (cached) return cached;
  const definition = protoLoader.loadSync(path.join(protoDir, SERVICE_PROTO), {
    ...LOADER_OPTIONS,
    includeDirs: [protoDir],
  });
  const loaded = grpc.loadPackageDefinition(definition) as unknown as {
    context_engine: { v1: { ContextEngine: grpc.ServiceClientConstructor } };
  };
  const ctor = loaded.context_engine.v1.ContextEngine;
  serviceCache.set(protoDir, ctor);
  return ctor;
}

/** The package definition itself (used to stand up a service in tests). */
export function loadPackageDefinition(protoDir: string): protoLoader.PackageDefinition {
  return protoLoader.loadSync(path.join(protoDir, SERVICE_PROTO), {
    ...LOADER_OPTIONS,
    includeDirs: [protoDir],
  });
}

let rpcRoot: protobuf.Root | undefined;

/**
 * `google.rpc.Status`, `ErrorInfo` and `BadRequest`. Their `google/protobuf` imports (`any`,
 * `duration`) are protobufjs's bundled well-known types.
 */
export function googleRpcRoot(): protobuf.Root {
  if (rpcRoot) return rpcRoot;
  const root = new protobuf.Root();
  root.resolvePath = (origin: string, target: string): string => {
    if (target.startsWith("google/rpc/")) return path.join(GOOGLE_RPC_PROTO_DIR, target);
    return protobuf.util.path.resolve(origin, target);
  };
  root.loadSync(["google/rpc/status.proto", "google/rpc/error_details.proto"]);
  root.resolveAll();
  rpcRoot = root;
  return root;
}
