/**
 * Incremental Build, the client's side: per session, the last Build's whole checkpoint items,
 * its `buildId` and the parts of its full response a delta refers to. `prepare` turns a whole
 * request into the request that goes on the wire (the items past the common prefix with the
 * held ones, `baseBuildId`, `baseItemsKept`); `absorb` turns the answer back into the full
 * response (`ResponseDelta`: message spans, the prefix from the base, UTF-8 byte spans of the
 * provider body and of the two Gemini bodies) and checks it against the sizes the server sent.
 *
 * Byte arithmetic only: spans over text count UTF-8 bytes, never JavaScript string indices.
 * Nothing held is shared with the caller: items are cloned when first seen, and the response
 * handed back is a copy of the one held.
 */
import {
  BuildRequest,
  type BuildResponse,
  Checkpoint,
  ConversationItem,
  type GeminiCachedContent,
  type Message,
  type PrefixBlock,
  type Span,
  type ToolDefinition,
} from "./gen/context_engine/v1/context_engine";
import { DecimalWriter } from "./int64";

/** The `ErrorInfo.reason` of a Build whose base the replica does not hold. */
export const BUILD_BASE_UNKNOWN = "BUILD_BASE_UNKNOWN";

/** Sessions whose last Build a client holds unless told otherwise. */
export const DEFAULT_MAX_SESSIONS = 1_024;
/** The sessions forgotten most recently whose turn is remembered (see `forget`). */
const FORGOTTEN_KEPT = 4_096;

/** What incremental Build moved, over the Builds that returned a response. */
export interface BuildStats {
  /** Builds that returned. */
  readonly builds: number;
  /** Of those, answered from a base (the response carried a delta). */
  readonly incremental: number;
  /** Builds sent again whole: the replica did not hold the base, or a delta did not check. */
  readonly fullResends: number;
  /** Serialized requests sent, resends included. */
  readonly requestBytes: number;
  /** Serialized responses received, resends included. */
  readonly responseBytes: number;
  /** What the same Builds would have sent whole. */
  readonly fullRequestBytes: number;
  /** What their full responses weigh. */
  readonly fullResponseBytes: number;
  /** `fullRequestBytes + fullResponseBytes - requestBytes - responseBytes`. */
  readonly bytesSaved: number;
}

/** A delta that does not read back: the Build is sent again whole. */
export class DeltaMismatchError extends Error {
  override readonly name = "DeltaMismatchError";
}

interface HeldItem {
  /** A clone of the request's item: the caller may change its own afterwards. */
  readonly item: ConversationItem;
  /** Its serialized size. */
  readonly size: number;
}

/** One session's last Build. Never changed once made; never handed to the caller. */
interface Held {
  readonly buildId: string;
  readonly items: readonly HeldItem[];
  readonly prefixBlocks: readonly PrefixBlock[];
  readonly tools: readonly ToolDefinition[];
  /** Serialized size of request.prefix_blocks and request.tools, tags included. */
  readonly prefixBytes: number;
  readonly messages: readonly Message[];
  /** Serialized size of each message. */
  readonly messageSizes: readonly number[];
  /** UTF-8 bytes of provider_body_json and of the two Gemini bodies. */
  readonly body: Uint8Array;
  readonly geminiCreate: Uint8Array;
  readonly geminiCached: Uint8Array;
}

/** A Build ready to send: the wire bytes, what they stand for, and the base they name. */
export interface Prepared {
  /** The caller's request, whole (defaults filled in). */
  readonly request: BuildRequest;
  /** What goes on the wire: `request` with the items past the kept ones and the base named. */
  readonly wire: BuildRequest;
  /** `wire`, serialized. */
  readonly bytes: Uint8Array;
  /** The serialized size of `request` (what a whole Build sends). */
  readonly fullRequestBytes: number;
  /** The held Build named as the base, or none (a whole Build). */
  readonly baseBuildId: string;
  /** Items of the base kept (the common prefix). */
  readonly kept: number;
  readonly base: Held | undefined;
  /** The whole request's items, as the session will hold them. */
  readonly items: readonly HeldItem[];
  /** When it was prepared: a session forgotten since is not held again by its answer. */
  readonly mark: number;
}

/** The full response and what it weighs. */
export interface Absorbed {
  /** The full response (`delta` unset, `buildId` as sent): the caller's own copy. */
  readonly response: BuildResponse;
  readonly fullResponseBytes: number;
  /** Whether it was read back from a delta. */
  readonly incremental: boolean;
}

// ------------------------------------------------------------------------------- values

/** A deep copy of a generated message's plain value: objects, arrays, bytes, dates. */
export function cloneValue<T>(value: T): T {
  if (value === null || typeof value !== "object") return value;
  if (Array.isArray(value)) {
    const out = new Array<unknown>(value.length);
    for (let i = 0; i < value.length; i++) out[i] = cloneValue(value[i] as unknown);
    return out as T;
  }
  if (Buffer.isBuffer(value)) return Buffer.from(value) as T;
  if (value instanceof Uint8Array) return value.slice() as T;
  if (value instanceof Date) return new Date(value.getTime()) as T;
  const out: Record<string, unknown> = {};
  const record = value as Record<string, unknown>;
  for (const key of Object.keys(record)) out[key] = cloneValue(record[key]);
  return out as T;
}

/**
 * Equality by value of two generated messages' plain values. Two values it calls equal
 * serialize to the same bytes; it may call unequal values that do (NaN, a number given for a
 * 64-bit string), which only costs sending an item again.
 */
export function valuesEqual(a: unknown, b: unknown): boolean {
  if (a === b) return true;
  if (a === null || b === null || typeof a !== "object" || typeof b !== "object") return false;
  if (Array.isArray(a)) {
    if (!Array.isArray(b) || a.length !== b.length) return false;
    for (let i = 0; i < a.length; i++) if (!valuesEqual(a[i], b[i])) return false;
    return true;
  }
  if (Array.isArray(b)) return false;
  if (a instanceof Uint8Array || b instanceof Uint8Array) {
    return a instanceof Uint8Array && b instanceof Uint8Array && Buffer.compare(a, b) === 0;
  }
  if (a instanceof Date || b instanceof Date) {
    return a instanceof Date && b instanceof Date && a.getTime() === b.getTime();
  }
  const ra = a as Record<string, unknown>;
  const rb = b as Record<string, unknown>;
  for (const key of Object.keys(ra)) if (!valuesEqual(ra[key], rb[key])) return false;
  for (const key of Object.keys(rb)) if (!(key in ra) && rb[key] !== undefined) return false;
  return true;
}

// ---------------------------------------------------------------------- wire arithmetic

function varintLength(n: number): number {
  let len = 1;
  while (n >= 0x80) {
    n = Math.floor(n / 0x80);
    len++;
  }
  return len;
}

function writeVarint(out: Uint8Array, pos: number, n: number): number {
  while (n >= 0x80) {
    out[pos++] = (n % 0x80) | 0x80;
    n = Math.floor(n / 0x80);
  }
  out[pos++] = n;
  return pos;
}

/** The serialized size of a length-delimited field of `size` bytes with a `tagBytes` tag. */
function fieldLength(tagBytes: number, size: number): number {
  return tagBytes + varintLength(size) + size;
}

/** A string field's serialized size (absent when empty, as proto3 writes it). */
function stringFieldLength(tagBytes: number, utf8Bytes: number): number {
  return utf8Bytes === 0 ? 0 : fieldLength(tagBytes, utf8Bytes);
}

/** A message's fields as they lie in its bytes. */
interface Scanned {
  /** Serialized bytes per field number, tags included, every occurrence summed. */
  readonly fieldBytes: Map<number, number>;
  /** Where each occurrence of a length-delimited field's value lies: [start, end). */
  readonly values: Map<number, [number, number][]>;
}

function readVarint(bytes: Uint8Array, pos: number): [number, number] {
  let value = 0;
  let scale = 1;
  for (;;) {
    if (pos >= bytes.length) throw new DeltaMismatchError("truncated varint in the response");
    const b = bytes[pos++]!;
    value += (b & 0x7f) * scale;
    if (b < 0x80) return [value, pos];
    scale *= 0x80;
    if (scale > 2 ** 63) throw new DeltaMismatchError("varint too long in the response");
  }
}

/** Walks the fields of the message in `bytes[start:end]` without decoding them. */
function scan(bytes: Uint8Array, start = 0, end = bytes.length): Scanned {
  const fieldBytes = new Map<number, number>();
  const values = new Map<number, [number, number][]>();
  let pos = start;
  while (pos < end) {
    const from = pos;
    const [tag, afterTag] = readVarint(bytes, pos);
    const field = Math.floor(tag / 8);
    const wireType = tag % 8;
    pos = afterTag;
    if (wireType === 0) {
      pos = readVarint(bytes, pos)[1];
    } else if (wireType === 1) {
      pos += 8;
    } else if (wireType === 5) {
      pos += 4;
    } else if (wireType === 2) {
      const [len, afterLen] = readVarint(bytes, pos);
      pos = afterLen + len;
      let list = values.get(field);
      if (list === undefined) values.set(field, list = []);
      list.push([afterLen, pos]);
    } else {
      throw new DeltaMismatchError(`wire type ${wireType} in the response`);
    }
    if (pos > end) throw new DeltaMismatchError("a field runs past its message");
    fieldBytes.set(field, (fieldBytes.get(field) ?? 0) + pos - from);
  }
  return { fieldBytes, values };
}

/** The single occurrence of a message field, or none. */
function onlyValue(scanned: Scanned, field: number, what: string): [number, number] | undefined {
  const list = scanned.values.get(field);
  if (list === undefined) return undefined;
  if (list.length !== 1) throw new DeltaMismatchError(`${what} occurs ${list.length} times`);
  return list[0];
}

// BuildResponse field numbers (and their tags' sizes) the arithmetic below uses.
const RESPONSE_REQUEST = 1;
const RESPONSE_PROVIDER_BODY = 16;
const RESPONSE_GEMINI = 18;
const RESPONSE_DELTA = 20;
const MODEL_REQUEST_PREFIX_BLOCKS = 1;
const MODEL_REQUEST_TOOLS = 2;
const MODEL_REQUEST_MESSAGES = 3;
/** Tags of fields 1-15 take one byte, 16-2047 two. */
const TAG_1 = 1;
const TAG_2 = 2;
// Checkpoint.items is field 2 and BuildRequest.checkpoint field 4, both length-delimited.
const ITEMS_TAG = 0x12;
const CHECKPOINT_TAG = 0x22;

/** What a response's request holds, measured in its bytes. */
interface RequestLayout {
  /** Serialized size of the ModelRequest, and of its prefix blocks and tools. */
  readonly size: number;
  readonly prefixBytes: number;
  /** Serialized size of each message (without its tag and length). */
  readonly messageSizes: number[];
  /** The size of every other field (none today; a newer server's fields). */
  readonly otherBytes: number;
}

function requestLayout(bytes: Uint8Array, top: Scanned): RequestLayout | undefined {
  const at = onlyValue(top, RESPONSE_REQUEST, "BuildResponse.request");
  if (at === undefined) return undefined;
  const inner = scan(bytes, at[0], at[1]);
  const prefixBytes = (inner.fieldBytes.get(MODEL_REQUEST_PREFIX_BLOCKS) ?? 0) +
    (inner.fieldBytes.get(MODEL_REQUEST_TOOLS) ?? 0);
  const messageSizes = (inner.values.get(MODEL_REQUEST_MESSAGES) ?? []).map(([s, e]) => e - s);
  const size = at[1] - at[0];
  const otherBytes = size - prefixBytes - (inner.fieldBytes.get(MODEL_REQUEST_MESSAGES) ?? 0);
  return { size, prefixBytes, messageSizes, otherBytes };
}

// ------------------------------------------------------------------------ reconstruction

/**
 * The full sequence a list of spans describes: for each span, `baseCount` entries of `base`
 * from `baseStart`, then the next `newCount` entries of `sent`, which must all be consumed.
 */
export function applySpans<T>(base: readonly T[], sent: readonly T[], spans: readonly Span[],
                              what: string): T[] {
  const out: T[] = [];
  let next = 0;
  for (const span of spans) {
    if (span.baseStart + span.baseCount > base.length) {
      throw new DeltaMismatchError(`${what}: span [${span.baseStart}, +${span.baseCount}) ` +
        `past the base's ${base.length}`);
    }
    if (next + span.newCount > sent.length) {
      throw new DeltaMismatchError(`${what}: ${span.newCount} new entries asked, ` +
        `${sent.length - next} left`);
    }
    for (let i = span.baseStart; i < span.baseStart + span.baseCount; i++) out.push(base[i]!);
    for (let i = 0; i < span.newCount; i++) out.push(sent[next++]!);
  }
  if (next !== sent.length) {
    throw new DeltaMismatchError(`${what}: ${sent.length - next} sent entries left over`);
  }
  return out;
}

/** The same over UTF-8 bytes: the base's bytes and the sent text's bytes. */
export function applyByteSpans(base: Uint8Array, sent: Uint8Array, spans: readonly Span[],
                               what: string): Uint8Array {
  const parts: Uint8Array[] = [];
  let next = 0;
  let total = 0;
  for (const span of spans) {
    if (span.baseStart + span.baseCount > base.length) {
      throw new DeltaMismatchError(`${what}: span [${span.baseStart}, +${span.baseCount}) ` +
        `past the base's ${base.length} bytes`);
    }
    if (next + span.newCount > sent.length) {
      throw new DeltaMismatchError(`${what}: ${span.newCount} new bytes asked, ` +
        `${sent.length - next} left`);
    }
    parts.push(base.subarray(span.baseStart, span.baseStart + span.baseCount));
    parts.push(sent.subarray(next, next + span.newCount));
    next += span.newCount;
    total += span.baseCount + span.newCount;
  }
  if (next !== sent.length) {
    throw new DeltaMismatchError(`${what}: ${sent.length - next} sent bytes left over`);
  }
  return Buffer.concat(parts, total);
}

const UTF8 = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true });
const EMPTY: Uint8Array = new Uint8Array(0);

function utf8(text: string): Uint8Array {
  return text === "" ? EMPTY : Buffer.from(text, "utf8");
}

function fromUtf8(bytes: Uint8Array, what: string): string {
  try {
    return UTF8.decode(bytes);
  } catch {
    throw new DeltaMismatchError(`${what}: the reconstruction is not valid UTF-8`);
  }
}

/** A text field in full: its spans over the base's bytes, or the sent text when none. */
function textInFull(base: Uint8Array, sent: string, spans: readonly Span[],
                    what: string): { text: string; bytes: Uint8Array } {
  if (spans.length === 0) return { text: sent, bytes: utf8(sent) };
  const bytes = applyByteSpans(base, utf8(sent), spans, what);
  return { text: fromUtf8(bytes, what), bytes };
}

// -------------------------------------------------------------------------------- state

function sessionKey(tenantId: string, sessionId: string): string {
  return JSON.stringify([tenantId, sessionId]);
}

function emptyStats(): Record<Exclude<keyof BuildStats, "bytesSaved">, number> {
  return { builds: 0, incremental: 0, fullResends: 0, requestBytes: 0, responseBytes: 0,
    fullRequestBytes: 0, fullResponseBytes: 0 };
}

/** One Build's bytes, counted once it returns. */
export interface BuildTally {
  incremental: boolean;
  fullResends: number;
  requestBytes: number;
  responseBytes: number;
  fullRequestBytes: number;
  fullResponseBytes: number;
}

/**
 * The held Builds of a client, least recently used evicted past `maxSessions`. Not tied to a
 * transport: `prepare` gives the bytes to send, `absorb` takes the bytes received.
 */
export class IncrementalBuilds {
  readonly maxSessions: number;
  private readonly held = new Map<string, Held>();
  private readonly counts = emptyStats();
  // Forgets counted, and when each session (of the last FORGOTTEN_KEPT) last was: a Build in
  // flight across one holds nothing of its answer.
  private forgets = 0;
  private readonly forgotten = new Map<string, number>();

  constructor(maxSessions = DEFAULT_MAX_SESSIONS) {
    if (!Number.isInteger(maxSessions) || maxSessions < 1) {
      throw new Error(`maxSessions must be an integer of at least 1 (incremental: false turns ` +
        `incremental Build off), got ${maxSessions}`);
    }
    this.maxSessions = maxSessions;
  }

  /** Sessions held now. */
  get size(): number {
    return this.held.size;
  }

  /** Whether a session's last Build is held. */
  holds(tenantId: string, sessionId: string): boolean {
    return this.held.has(sessionKey(tenantId, sessionId));
  }

  /**
   * Drops a session's held Build: its next Build goes whole. A Build of the session in flight
   * holds nothing of its answer either (it was based on what is forgotten, or on a session
   * deleted since).
   */
  forget(tenantId: string, sessionId: string): void {
    const key = sessionKey(tenantId, sessionId);
    this.held.delete(key);
    this.forgets += 1;
    this.forgotten.delete(key);
    this.forgotten.set(key, this.forgets);
    while (this.forgotten.size > FORGOTTEN_KEPT) {
      this.forgotten.delete(this.forgotten.keys().next().value as string);
    }
  }

  /** Drops a session's held Build without counting a forget (a resend of a Build in flight). */
  drop(tenantId: string, sessionId: string): void {
    this.held.delete(sessionKey(tenantId, sessionId));
  }

  /** The counts so far. */
  stats(): BuildStats {
    const c = this.counts;
    return Object.freeze({ ...c, bytesSaved: c.fullRequestBytes + c.fullResponseBytes -
      c.requestBytes - c.responseBytes });
  }

  /** Adds a returned Build's tally to the counts. */
  count(tally: BuildTally): void {
    const c = this.counts;
    c.builds += 1;
    if (tally.incremental) c.incremental += 1;
    c.fullResends += tally.fullResends;
    c.requestBytes += tally.requestBytes;
    c.responseBytes += tally.responseBytes;
    c.fullRequestBytes += tally.fullRequestBytes;
    c.fullResponseBytes += tally.fullResponseBytes;
  }

  /**
   * The wire request for `request` (whole, defaults filled in; not changed): the items past
   * the longest common prefix with the session's held items, naming the held Build as base.
   * Without a held Build, or with `whole`, the request whole. `mark`: the forgets counted when
   * the Build began (a resend carries its first attempt's).
   */
  prepare(request: BuildRequest, whole = false, mark = this.forgets): Prepared {
    if (request.baseBuildId !== "" || request.baseItemsKept !== 0) {
      throw new Error("the request names a base itself: send it as it is");
    }
    const key = sessionKey(request.tenantId, request.sessionId);
    const base = whole ? undefined : this.held.get(key);
    if (base !== undefined) {  // most recently used
      this.held.delete(key);
      this.held.set(key, base);
    }
    const checkpoint = request.checkpoint;
    const items = checkpoint?.items ?? [];
    let kept = 0;
    if (base !== undefined) {
      const limit = Math.min(base.items.length, items.length);
      while (kept < limit && valuesEqual(base.items[kept]!.item, items[kept])) kept++;
    }
    // The items the session will hold: the held ones kept, clones of the others.
    const held: HeldItem[] = base === undefined ? [] : base.items.slice(0, kept);
    const encoded: Uint8Array[] = [];
    for (let i = kept; i < items.length; i++) {
      const item = cloneValue(items[i]!);
      const bytes = ConversationItem.encode(item, new DecimalWriter()).finish();
      held.push({ item, size: bytes.length });
      encoded.push(bytes);
    }
    const baseBuildId = base?.buildId ?? "";
    // A whole Build asks the replica to keep it as the next one's base (one naming a base is
    // kept anyway).
    const keepBase = request.keepBase || base === undefined;
    const wire: BuildRequest = base === undefined ? { ...request, keepBase } : {
      ...request, baseBuildId, baseItemsKept: kept,
      checkpoint: checkpoint === undefined ? undefined : { ...checkpoint,
        items: items.slice(kept) },
    };

    // Serialized in field order, each new item encoded once: tenant, session, epoch (1-3),
    // the checkpoint (4: active_run_id, the items past the kept ones, the rest), then the
    // fields from 5 on, the base and keep_base among them.
    const head = BuildRequest.encode(BuildRequest.fromPartial({ tenantId: request.tenantId,
      sessionId: request.sessionId, epoch: request.epoch }), new DecimalWriter()).finish();
    const tail = BuildRequest.encode({ ...wire, tenantId: "", sessionId: "", epoch: 0,
      checkpoint: undefined }, new DecimalWriter()).finish();
    // What the tail holds that the caller's request does not: the base, keep_base.
    const baseFields = stringFieldLength(TAG_1, Buffer.byteLength(baseBuildId, "utf8")) +
      (kept === 0 ? 0 : TAG_1 + varintLength(kept)) +
      (wire.keepBase && !request.keepBase ? TAG_1 + 1 : 0);
    let cpA: Uint8Array = EMPTY;
    let cpB: Uint8Array = EMPTY;
    let wireItems = 0;
    let keptItems = 0;
    if (checkpoint !== undefined) {
      cpA = Checkpoint.encode(Checkpoint.fromPartial({ activeRunId: checkpoint.activeRunId }),
        new DecimalWriter()).finish();
      cpB = Checkpoint.encode({ ...checkpoint, activeRunId: "", items: [] }, new DecimalWriter())
        .finish();
      for (const bytes of encoded) wireItems += fieldLength(TAG_1, bytes.length);
      for (let i = 0; i < kept; i++) keptItems += fieldLength(TAG_1, held[i]!.size);
    }
    const wireCheckpoint = cpA.length + wireItems + cpB.length;
    const fullCheckpoint = wireCheckpoint + keptItems;
    const checkpointField = (size: number) => checkpoint === undefined ? 0
      : fieldLength(TAG_1, size);
    const total = head.length + checkpointField(wireCheckpoint) + tail.length;
    const bytes = new Uint8Array(total);
    bytes.set(head, 0);
    let pos = head.length;
    if (checkpoint !== undefined) {
      bytes[pos++] = CHECKPOINT_TAG;
      pos = writeVarint(bytes, pos, wireCheckpoint);
      bytes.set(cpA, pos);
      pos += cpA.length;
      for (const item of encoded) {
        bytes[pos++] = ITEMS_TAG;
        pos = writeVarint(bytes, pos, item.length);
        bytes.set(item, pos);
        pos += item.length;
      }
      bytes.set(cpB, pos);
      pos += cpB.length;
    }
    bytes.set(tail, pos);
    const fullRequestBytes = head.length + checkpointField(fullCheckpoint) + tail.length -
      baseFields;
    return { request, wire, bytes, fullRequestBytes, baseBuildId, kept, base, items: held,
      mark };
  }

  /**
   * The full response to a prepared Build from the response received (`wireBytes`: its
   * serialized form, as it arrived), checked against the sizes the delta states, and held as
   * the session's base. Throws {@link DeltaMismatchError} when it does not read back (the
   * caller then forgets the session and sends the Build whole).
   */
  absorb(prepared: Prepared, received: BuildResponse, wireBytes: Uint8Array): Absorbed {
    const { base } = prepared;
    const delta = received.delta;
    const top = scan(wireBytes);
    const layout = requestLayout(wireBytes, top);
    if (delta === undefined) {
      if (base !== undefined) {
        // A server that does not know base_build_id answered for the items sent alone: the
        // Build goes again whole. Only this Build: such a server keeps nothing (it answers no
        // build_id), so no later Build names a base to it, while the replicas beside it that
        // keep bases go on serving them.
        throw new DeltaMismatchError("the server answered a Build naming a base without a " +
          "delta: it ignores bases");
      }
      const body = utf8(received.providerBodyJson);
      const gemini = received.geminiCachedContent;
      this.hold(prepared, received, {
        prefixBytes: layout?.prefixBytes ?? 0, messageSizes: layout?.messageSizes ?? [],
        body, geminiCreate: utf8(gemini?.createBodyJson ?? ""),
        geminiCached: utf8(gemini?.cachedBodyJson ?? ""),
      });
      return { response: cloneValue(received), fullResponseBytes: wireBytes.length,
        incremental: false };
    }
    if (base === undefined) {
      throw new DeltaMismatchError("a delta answers a Build that named no base");
    }
    if (delta.baseBuildId !== base.buildId) {
      throw new DeltaMismatchError(`the delta's base is ${JSON.stringify(delta.baseBuildId)}, ` +
        `the Build named ${JSON.stringify(base.buildId)}`);
    }

    // request: the prefix from the base or as sent; messages from the spans or as sent.
    const sentRequest = received.request;
    const sentMessages = sentRequest?.messages ?? [];
    const sentSizes = layout?.messageSizes ?? [];
    if (sentSizes.length !== sentMessages.length) {
      throw new DeltaMismatchError("the response's messages do not match its bytes");
    }
    const fromBase = delta.prefixFromBase;
    const spans = delta.messageSpans;
    const messages = spans.length === 0 ? sentMessages
      : applySpans(base.messages, sentMessages, spans, "request.messages");
    const messageSizes = spans.length === 0 ? sentSizes
      : applySpans(base.messageSizes, sentSizes, spans, "request.messages");
    const hasRequest = sentRequest !== undefined || fromBase || spans.length > 0;
    const request = !hasRequest ? undefined : {
      prefixBlocks: fromBase ? [...base.prefixBlocks] : sentRequest?.prefixBlocks ?? [],
      tools: fromBase ? [...base.tools] : sentRequest?.tools ?? [],
      messages,
    };
    const prefixBytes = fromBase ? base.prefixBytes : layout?.prefixBytes ?? 0;

    // provider_body_json and the two Gemini bodies: UTF-8 byte spans.
    const body = textInFull(base.body, received.providerBodyJson, delta.providerBodySpans,
      "provider_body_json");
    if (String(body.bytes.length) !== delta.providerBodyBytes) {
      throw new DeltaMismatchError(`provider_body_json is ${body.bytes.length} bytes, the ` +
        `delta says ${delta.providerBodyBytes}`);
    }
    const sentGemini = received.geminiCachedContent;
    if (sentGemini === undefined && (delta.geminiCreateBodySpans.length > 0 ||
        delta.geminiCachedBodySpans.length > 0)) {
      throw new DeltaMismatchError("Gemini body spans without gemini_cached_content");
    }
    let gemini: GeminiCachedContent | undefined;
    let geminiCreate: Uint8Array = EMPTY;
    let geminiCached: Uint8Array = EMPTY;
    if (sentGemini !== undefined) {
      const create = textInFull(base.geminiCreate, sentGemini.createBodyJson,
        delta.geminiCreateBodySpans, "gemini_cached_content.create_body_json");
      const cached = textInFull(base.geminiCached, sentGemini.cachedBodyJson,
        delta.geminiCachedBodySpans, "gemini_cached_content.cached_body_json");
      gemini = { ...sentGemini, createBodyJson: create.text, cachedBodyJson: cached.text };
      geminiCreate = create.bytes;
      geminiCached = cached.bytes;
    }

    const full: BuildResponse = { ...received, request, providerBodyJson: body.text,
      geminiCachedContent: gemini, delta: undefined };

    // Its serialized size: the bytes received, with the request, the bodies and the delta
    // replaced by what the full response holds.
    let size = wireBytes.length;
    for (const field of [RESPONSE_REQUEST, RESPONSE_PROVIDER_BODY, RESPONSE_GEMINI,
      RESPONSE_DELTA]) {
      size -= top.fieldBytes.get(field) ?? 0;
    }
    if (request !== undefined) {
      let inner = (layout?.otherBytes ?? 0) + prefixBytes;
      for (const s of messageSizes) inner += fieldLength(TAG_1, s);
      size += fieldLength(TAG_1, inner);
    }
    size += stringFieldLength(TAG_2, body.bytes.length);
    if (gemini !== undefined) {
      const at = onlyValue(top, RESPONSE_GEMINI, "BuildResponse.gemini_cached_content");
      const sent = sentGemini!;
      const inner = (at === undefined ? 0 : at[1] - at[0]) -
        stringFieldLength(TAG_1, Buffer.byteLength(sent.createBodyJson, "utf8")) -
        stringFieldLength(TAG_1, Buffer.byteLength(sent.cachedBodyJson, "utf8")) +
        stringFieldLength(TAG_1, geminiCreate.length) +
        stringFieldLength(TAG_1, geminiCached.length);
      size += fieldLength(TAG_2, inner);
    }
    if (String(size) !== delta.fullResponseBytes) {
      throw new DeltaMismatchError(`the full response is ${size} bytes, the delta says ` +
        `${delta.fullResponseBytes}`);
    }
    this.hold(prepared, full, { prefixBytes, messageSizes, body: body.bytes, geminiCreate,
      geminiCached });
    return { response: cloneValue(full), fullResponseBytes: size, incremental: true };
  }

  /** Whether the session was forgotten after `mark` (or more were than are remembered). */
  private forgottenSince(key: string, mark: number): boolean {
    if (this.forgets === mark) return false;
    if (this.forgets - mark > FORGOTTEN_KEPT) return true;
    return (this.forgotten.get(key) ?? 0) > mark;
  }

  private hold(prepared: Prepared, full: BuildResponse, sizes: {
    prefixBytes: number; messageSizes: readonly number[]; body: Uint8Array;
    geminiCreate: Uint8Array; geminiCached: Uint8Array;
  }): void {
    if (full.buildId === "") return;
    const key = sessionKey(prepared.request.tenantId, prepared.request.sessionId);
    if (this.forgottenSince(key, prepared.mark)) return;  // forgotten while in flight
    this.held.delete(key);
    this.held.set(key, {
      buildId: full.buildId,
      items: prepared.items,
      prefixBlocks: full.request?.prefixBlocks ?? [],
      tools: full.request?.tools ?? [],
      messages: full.request?.messages ?? [],
      ...sizes,
    });
    while (this.held.size > this.maxSessions) {
      const oldest = this.held.keys().next().value as string;
      this.held.delete(oldest);
    }
  }
}
