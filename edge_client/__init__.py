"""The edge client: drafters, the link to the cloud server, the round loop and the CLI.

Importing this package never imports torch: an edge device installs onnxruntime, tokenizers,
grpcio and numpy only.
"""
import os

# grpc core logs a dropped link at INFO ("Got goaway ... ping_timeout"); the client reports link
# events itself, in one line a user can read. Set GRPC_VERBOSITY to see grpc's own again.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
