/**
 * Drives the client's incremental Build for a test in another language: one JSON object per
 * line on standard input, one JSON answer per line on standard output, in order.
 *
 *   {"op": "build", "target": "127.0.0.1:PORT", "request_b64": "<BuildRequest, base64>"}
 *     -> {"response_b64": "<the full BuildResponse, base64>", "stats": {...}}
 *   {"op": "stats"}                  -> the BuildStats of every target's client, summed
 *   {"op": "stats", "target": "..."} -> that target's client's
 *   {"op": "forget", "target": "...", "tenant_id": "...", "session_id": "..."} -> {"ok": true}
 *   {"op": "quit"}                   -> {"ok": true}, then exits 0
 *
 * One ContextEngineClient per target, incremental on, kept for the process's life: a session
 * sent to another target is what a replica switch is (that client holds no base for it; the
 * first one keeps its own, which its replica may or may not still hold). A failure answers
 * {"error": "<message>", "code": "<gRPC code name>", "reason": "<ErrorInfo reason>"}, with
 * "violations": [[field, description], ...] when it names bad fields, and the driver goes on. Plaintext channels; a token, if any, from CE_TOKEN.
 *
 *   node clients/typescript/dist/test-driver/incremental_driver.js
 */
import * as readline from "node:readline";

import {
  type BuildStats,
  BuildRequest,
  BuildResponse,
  ContextEngineClient,
  ContextEngineError,
} from "../src";

const clients = new Map<string, ContextEngineClient>();

function clientFor(target: string): ContextEngineClient {
  let client = clients.get(target);
  if (client === undefined) {
    client = new ContextEngineClient({ target, insecure: true, incremental: true,
      token: process.env.CE_TOKEN || undefined, deadlineMs: 60_000 });
    clients.set(target, client);
  }
  return client;
}

function summed(all: BuildStats[]): Record<string, number> {
  const out: Record<string, number> = { builds: 0, incremental: 0, fullResends: 0,
    requestBytes: 0, responseBytes: 0, fullRequestBytes: 0, fullResponseBytes: 0,
    bytesSaved: 0 };
  for (const stats of all) {
    for (const [key, value] of Object.entries(stats)) out[key] = (out[key] ?? 0) + value;
  }
  return out;
}

function text(value: unknown, name: string): string {
  if (typeof value !== "string" || value === "") throw new Error(`"${name}" must be a string`);
  return value;
}

async function answer(line: string): Promise<Record<string, unknown>> {
  const message = JSON.parse(line) as Record<string, unknown>;
  switch (message.op) {
    case "build": {
      const client = clientFor(text(message.target, "target"));
      const request = BuildRequest.decode(Buffer.from(text(message.request_b64, "request_b64"),
        "base64"));
      const response = await client.build(request);
      return { response_b64: Buffer.from(BuildResponse.encode(response).finish())
        .toString("base64"), stats: client.buildStats() };
    }
    case "stats":
      if (message.target !== undefined) {
        return { ...clientFor(text(message.target, "target")).buildStats() };
      }
      return summed([...clients.values()].map((c) => c.buildStats()));
    case "forget":
      clientFor(text(message.target, "target")).forgetSession(
        text(message.tenant_id, "tenant_id"), text(message.session_id, "session_id"));
      return { ok: true };
    case "quit":
      return { ok: true };
    default:
      throw new Error(`unknown op ${JSON.stringify(message.op)}`);
  }
}

function failure(err: unknown): Record<string, unknown> {
  if (err instanceof ContextEngineError) {
    const out: Record<string, unknown> = { error: err.message, code: err.codeName,
      reason: err.reason };
    if (err.violations.length > 0) {
      out.violations = err.violations.map((v) => [v.field, v.description]);
    }
    return out;
  }
  return { error: err instanceof Error ? `${err.name}: ${err.message}` : String(err) };
}

function write(value: Record<string, unknown>): Promise<void> {
  return new Promise((resolve, reject) => process.stdout.write(`${JSON.stringify(value)}\n`,
    (err) => (err ? reject(err) : resolve())));
}

async function main(): Promise<number> {
  const lines = readline.createInterface({ input: process.stdin, crlfDelay: Infinity });
  try {
    for await (const line of lines) {
      if (line.trim() === "") continue;
      let quit = false;
      let out: Record<string, unknown>;
      try {
        quit = (JSON.parse(line) as { op?: unknown }).op === "quit";
        out = await answer(line);
      } catch (err) {
        out = failure(err);
      }
      await write(out);
      if (quit) break;
    }
  } finally {
    for (const client of clients.values()) client.close();
  }
  return 0;
}

main().then((code) => process.exit(code), (err: unknown) => {
  process.stderr.write(`incremental_driver: ${err instanceof Error ? err.stack : String(err)}\n`);
  process.exit(1);
});
