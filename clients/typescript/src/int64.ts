/**
 * The writer requests are encoded with: the generated codecs' own, but a 64-bit integer must be
 * a decimal string (`"12"`, `"-3"`), as this package's types and README give them, or a safe
 * integer. The codecs' writer reads a string with `BigInt()`, which takes `""` as 0, `" 3 "`
 * and `"+3"` as 3 and `"0x10"` as 16 and sends them; a number past 2^53 - 1 is sent as the
 * double it was rounded to. Each is refused here before anything is sent.
 */
import { BinaryWriter } from "@bufbuild/protobuf/wire";

const DECIMAL = /^-?[0-9]+$/;

function checked<T>(value: T, kind: string): T {
  if (typeof value === "string" && !DECIMAL.test(value)) {
    throw new SyntaxError(`invalid ${kind} ${JSON.stringify(value)}: 64-bit integers are ` +
      'decimal strings, e.g. "12"');
  }
  if (typeof value === "number" && !Number.isSafeInteger(value)) {
    throw new RangeError(`invalid ${kind} ${value}: a number must be an integer of at most ` +
      "2^53 - 1 in magnitude (past it, it may have been rounded): give it as a decimal string");
  }
  return value;
}

/** A BinaryWriter that refuses a 64-bit integer given in any form but a decimal string, a
 * safe integer or a bigint (a SyntaxError or a RangeError); the range is the codec's to check. */
export class DecimalWriter extends BinaryWriter {
  override int64(value: string | number | bigint): this {
    return super.int64(checked(value, "int64"));
  }

  override uint64(value: string | number | bigint): this {
    return super.uint64(checked(value, "uint64"));
  }

  override sint64(value: string | number | bigint): this {
    return super.sint64(checked(value, "sint64"));
  }

  override fixed64(value: string | number | bigint): this {
    return super.fixed64(checked(value, "fixed64"));
  }

  override sfixed64(value: string | number | bigint): this {
    return super.sfixed64(checked(value, "sfixed64"));
  }
}
