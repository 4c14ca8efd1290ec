"""The HTTP and gRPC listeners of one process, over a core (the `ServerCore` itself or a `RemoteCore`).

`kiln serve` runs them in its own process, or (`--frontend-processes N`) in N frontend processes that share the
HTTP port through SO_REUSEPORT (the kernel spreads connections over them) and serve the gRPC connections the
server process accepts and hands to them in turn (server/connection_handoff.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from server.auth import restrictions_from_args
from server.core import ServerCore
from server.core.limits import InflightLimiter, limits_from_args
from server.core.turn_groups import TurnGroups
from server.lifecycle import Lifecycle
from server.tls import TlsSettings, tls_from_args

log = logging.getLogger("kiln.server")


class UvicornServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to `serve` (several servers share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def make_uvicorn(app, host: str, port: int, name: str, graceful_s: float,
                 tls: TlsSettings | None = None, protocol: type | None = None) -> UvicornServer:
    """A uvicorn server for `app`; over TLS (uvicorn's ssl_* options) when `tls` is given; `protocol`: the HTTP
    protocol class per connection (default: uvicorn's choice)."""
    ssl_options = {} if tls is None else {
        "ssl_certfile": tls.cert, "ssl_keyfile": tls.key, "ssl_ca_certs": tls.root,
        "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.mutual else ssl.CERT_NONE}
    # no `server: uvicorn` header: Triton sends none, and it named a library, not the server (Date stays: RFC 9110)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=max(int(graceful_s), 1), http=protocol or "auto",
                            server_header=False, **ssl_options)
    server = UvicornServer(config)
    server.name = name  # type: ignore[attr-defined]
    server.tls = tls  # type: ignore[attr-defined]
    return server


def reload_certificates(listeners: Listeners) -> None:
    """SIGHUP: every TLS listener re-reads its certificate and key (new connections get them; open ones stay)."""
    for server in listeners.servers:
        tls = getattr(server, "tls", None)
        context = getattr(server.config, "ssl", None)  # the context uvicorn's sockets use (set once it loads)
        if tls is not None and context is not None:
            tls.reload(context, server.name)  # type: ignore[attr-defined]
    if listeners.grpc_server is not None:
        listeners.grpc_server.reload_certificates()


async def serve_listener(server: UvicornServer, sockets: list[socket.socket] | None = None) -> None:
    """Run one uvicorn server; a listener that cannot start (uvicorn exits) just ends, and `serve` stops."""
    try:
        await server.serve(sockets=sockets)
    except SystemExit:
        log.error("the %s listener could not start on port %s", server.name, server.config.port)  # type: ignore[attr-defined]


def tcp_socket(host: str, port: int, *, reuse_port: bool = True, listen: bool = True) -> socket.socket:
    """A TCP socket on host:port (port 0: any free one), non-blocking once it listens. `reuse_port`: SO_REUSEPORT,
    so frontend processes can each listen on the same port (off: one process accepts them all and hands them on,
    server/connection_handoff.py). `listen=False` only holds the port (the server process resolves port 0 and keeps
    the port for its frontends): a socket that does not listen gets no connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(2048)
            sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def start_grpc(core, host: str, port: int, **guard):
    try:
        from server.frontends.grpc import start_grpc_server
    except ImportError as e:
        log.warning("gRPC frontend unavailable (%s); serving HTTP only", e)
        return None
    return await start_grpc_server(core, host, port, **guard)


@dataclass
class Listeners:
    """What `start_listeners` started: uvicorn servers, the tasks serving them, the gRPC server."""

    servers: list[UvicornServer] = field(default_factory=list)
    tasks: list[asyncio.Task] = field(default_factory=list)
    grpc_server: Any = None


async def start_listeners(core, args: argparse.Namespace, lifecycle: Lifecycle, limiter: InflightLimiter,
                          reuse_port: bool = False, grpc_handoff: socket.socket | None = None) -> Listeners:
    """HTTP (when allowed) and gRPC (when allowed) over `core`; raises OSError when a port cannot be had.
    `reuse_port`: listen with SO_REUSEPORT (frontend processes sharing the ports); `grpc_handoff`: gRPC serves the
    connections the server process hands over this channel instead of listening (server/connection_handoff.py)."""
    from server.frontends.http import create_app
    from server.frontends.http.protocol import InferRoute, protocol_for

    limits = limits_from_args(args)
    http_restricted, grpc_restricted = restrictions_from_args(args)
    grpc_tls, http_tls, _ = tls_from_args(args)
    listeners = Listeners()
    # the inference roads submit each loop turn's alike requests as groups (a RemoteCore groups them itself)
    inference = TurnGroups(core) if isinstance(core, ServerCore) else core
    if args.allow_http:
        app = create_app(core, limits, limiter, http_restricted)
        server = make_uvicorn(lifecycle.wrap_asgi(app), args.host, args.http_port, "HTTP", lifecycle.settings.timeout_s,
                              http_tls, protocol_for(InferRoute(inference, app, lifecycle)))
        sockets = [tcp_socket(args.host, args.http_port)] if reuse_port else None
        listeners.servers.append(server)
        listeners.tasks.append(asyncio.create_task(serve_listener(server, sockets), name="HTTP"))
    if args.allow_grpc:
        listeners.grpc_server = await start_grpc(inference, args.grpc_address, args.grpc_port, limiter=limiter,
                                                 restricted=grpc_restricted, reuse_port=reuse_port, tls=grpc_tls,
                                                 handoff=grpc_handoff)
    return listeners
