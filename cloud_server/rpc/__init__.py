"""The gRPC surface: the service and its streams, status codes, TLS and auth, health, metrics,
the artifacts it serves and the server's start and graceful stop."""
