"""The gRPC surface: proto <-> domain mapping, error mapping, servicer and server."""
