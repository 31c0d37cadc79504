/** Where the package's files are once built (compiled code lives in `dist/src/`). */
import * as path from "node:path";

/** The package root: `package.json`, `proto/`, `dist/`. */
export const PACKAGE_ROOT = path.resolve(__dirname, "..", "..");

/**
 * The contract shipped with the package: `context_engine/v1/context_engine.proto` and the
 * `google/rpc` error model, for tools that want the `.proto` files themselves.
 */
export const PROTO_DIR = path.join(PACKAGE_ROOT, "proto");
