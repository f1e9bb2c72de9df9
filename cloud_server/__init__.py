"""The cloud server: the target model, sessions with their KV caches, tree verification, gRPC."""
