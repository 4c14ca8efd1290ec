"""Kiln's inference server: a Triton/KServe-compatible frontend (HTTP, gRPC, metrics) over `engine_core`.

Layout: `frontends/{http,grpc}` translate protocols -> `core` (models, inference, repository, statistics,
shared memory, settings) -> `engine_core`. See docs/server.md.
"""
