"""Transport options of the gRPC frontend and the grpcio channel arguments they become.

The defaults follow Triton's `--grpc-*` flags so that clients tuned for Triton behave the same here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import grpc

GIB = 1 << 30

_COMPRESSION = {
    "none": grpc.Compression.NoCompression,
    "gzip": grpc.Compression.Gzip,
    "deflate": grpc.Compression.Deflate,
}


@dataclass(frozen=True)
class GrpcOptions:
    """Everything `start_grpc_server(**options)` accepts."""

    max_message_size: int = GIB
    # Server-initiated keepalive pings (ms); Triton's defaults: 2 h interval, 20 s timeout.
    keepalive_time_ms: int = 7_200_000
    keepalive_timeout_ms: int = 20_000
    keepalive_permit_without_calls: bool = False
    http2_max_pings_without_data: int = 2
    http2_min_recv_ping_interval_without_data_ms: int = 300_000
    http2_max_ping_strikes: int = 2
    # Compression of responses: "none", "gzip" or "deflate". Compressed requests are always accepted.
    compression: str = "none"
    # Requests handled at once; further ones wait in grpcio's queue (None: no limit).
    max_concurrent_rpcs: int | None = None
    # In-flight requests per ModelStreamInfer stream before the server stops reading that stream.
    max_stream_inflight: int = 1024
    health: bool = True
    reflection: bool = True
    # Share the port with the other frontend processes of this server (kiln serve --frontend-processes).
    reuse_port: bool = False

    @classmethod
    def from_kwargs(cls, **options) -> GrpcOptions:
        """Validate `**options`; unknown names are an error rather than silently ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown gRPC option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        result = cls(**options)
        if result.compression not in _COMPRESSION:
            raise ValueError(f"compression must be one of {sorted(_COMPRESSION)}, got {result.compression!r}")
        if result.max_message_size <= 0 or result.max_stream_inflight <= 0:
            raise ValueError("max_message_size and max_stream_inflight must be positive")
        return result

    @property
    def grpc_compression(self) -> grpc.Compression:
        return _COMPRESSION[self.compression]

    def channel_args(self) -> list[tuple[str, int]]:
        """grpcio server options (channel arguments) for these settings."""
        return [
            ("grpc.max_send_message_length", self.max_message_size),
            ("grpc.max_receive_message_length", self.max_message_size),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", int(self.keepalive_permit_without_calls)),
            ("grpc.http2.max_pings_without_data", self.http2_max_pings_without_data),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", self.http2_min_recv_ping_interval_without_data_ms),
            ("grpc.http2.max_ping_strikes", self.http2_max_ping_strikes),
            # grpcio shares ports between processes by default; a second server on a busy port must fail instead,
            # unless this server's own frontend processes share it on purpose.
            ("grpc.so_reuseport", int(self.reuse_port)),
        ]
