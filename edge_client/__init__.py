"""The edge client: drafters, the link to the cloud server, the round loop and the CLI.

Importing this package never imports torch: an edge device installs onnxruntime, tokenizers,
grpcio and numpy only.
"""
