"""Transport options of the gRPC frontend and the HTTP/2 settings they become.

The defaults follow Triton's `--grpc-*` flags (grpcio's channel arguments of the same names) so that clients tuned
for Triton behave the same here.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass

from server.tls import TlsSettings

from .http2 import Http2Settings

GIB = 1 << 30

_COMPRESSION = ("none", "gzip", "deflate")


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
    # Calls handled at once; further ones get RESOURCE_EXHAUSTED (None: no limit), as grpcio's option does.
    max_concurrent_rpcs: int | None = None
    # In-flight requests per ModelStreamInfer stream before the server stops reading that stream.
    max_stream_inflight: int = 1024
    health: bool = True
    reflection: bool = True
    # Share the port with the other frontend processes of this server (kiln serve --frontend-processes).
    reuse_port: bool = False
    # Serve the connections the server process accepts and hands over this Unix channel instead of listening
    # (server/connection_handoff.py: frontend processes); None: listen on the port.
    handoff: socket.socket | None = None
    # TLS (Triton's --grpc-use-ssl, --grpc-use-ssl-mutual and their files); None: cleartext HTTP/2
    tls: TlsSettings | None = None

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

    def http2_settings(self) -> Http2Settings:
        """The HTTP/2 layer's settings for these options (grpcio's keepalive and ping-policing meanings)."""
        return Http2Settings(
            keepalive_time_s=self.keepalive_time_ms / 1000, keepalive_timeout_s=self.keepalive_timeout_ms / 1000,
            keepalive_permit_without_calls=self.keepalive_permit_without_calls,
            max_pings_without_data=self.http2_max_pings_without_data,
            min_recv_ping_interval_s=self.http2_min_recv_ping_interval_without_data_ms / 1000,
            max_ping_strikes=self.http2_max_ping_strikes)
