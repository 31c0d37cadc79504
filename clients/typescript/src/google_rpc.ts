/** The `google.rpc` error model generated from proto/google/rpc/, with `google.protobuf.Any`. */
export * from "./gen/google/rpc/error_details";
export { Status } from "./gen/google/rpc/status";
export { Any } from "./gen/google/protobuf/any";
export { Duration } from "./gen/google/protobuf/duration";
