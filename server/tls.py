"""TLS for the listeners: Triton's `--grpc-use-ssl*` flags for gRPC, the same shape for HTTP and metrics.

gRPC takes Triton's flags and meanings (`--grpc-use-ssl`, `--grpc-server-cert`, `--grpc-server-key`,
`--grpc-root-cert`, `--grpc-use-ssl-mutual`: client certificates signed by the root certificate are required).
Triton serves HTTP in the clear only; Kiln offers `--http-use-ssl` etc. with the same meanings, and
`--metrics-use-ssl` puts the metrics port behind the HTTP certificate too. Certificates and keys are re-read on
SIGHUP: new connections get the new ones, connections already open keep theirs (nothing is dropped).
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
from dataclasses import dataclass

from server.flags import parse_bool

log = logging.getLogger("kiln.server")


@dataclass(frozen=True)
class TlsSettings:
    """One listener's certificate, key and (for mutual TLS) the root certificate clients must chain to."""

    cert: str
    key: str
    root: str | None = None
    mutual: bool = False

    def context(self, alpn: list[str] | None = None) -> ssl.SSLContext:
        """A server-side context; `alpn`: the protocols to offer (gRPC clients insist on "h2")."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if alpn:
            context.set_alpn_protocols(alpn)
        self.load(context)
        if self.mutual:
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def load(self, context: ssl.SSLContext) -> None:
        """(Re-)read the files into `context`; the handshakes after it use them."""
        context.load_cert_chain(self.cert, self.key)
        if self.root:
            context.load_verify_locations(self.root)

    def reload(self, context: ssl.SSLContext, what: str) -> None:
        """SIGHUP: re-read; a file that no longer loads is logged and the certificates in use stay."""
        try:
            self.load(context)
        except (OSError, ssl.SSLError) as e:
            log.error("%s: could not re-read the TLS certificate (%s); the current one stays in use", what, e)
            return
        log.info("%s: TLS certificate re-read from %s", what, self.cert)


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    for protocol, origin in (("grpc", "Triton's flag"), ("http", "as --grpc-*")):
        parser.add_argument(f"--{protocol}-use-ssl", type=parse_bool, default=False, metavar="BOOL",
                            help=f"serve {protocol.upper()} over TLS ({origin}); needs the server certificate and key")
        parser.add_argument(f"--{protocol}-use-ssl-mutual", type=parse_bool, default=False, metavar="BOOL",
                            help="also require client certificates signed by the root certificate (implies TLS)")
        parser.add_argument(f"--{protocol}-server-cert", default="", metavar="FILE", help="PEM certificate chain")
        parser.add_argument(f"--{protocol}-server-key", default="", metavar="FILE", help="PEM private key")
        parser.add_argument(f"--{protocol}-root-cert", default="", metavar="FILE",
                            help="PEM root certificate(s) that client certificates must chain to (mutual TLS)")
    parser.add_argument("--metrics-use-ssl", type=parse_bool, default=False, metavar="BOOL",
                        help="serve the metrics port over TLS with the HTTP certificate and key (--http-server-*)")


def _settings(args: argparse.Namespace, protocol: str) -> TlsSettings | None:
    mutual = getattr(args, f"{protocol}_use_ssl_mutual")
    if not (getattr(args, f"{protocol}_use_ssl") or mutual):
        return None
    cert, key = getattr(args, f"{protocol}_server_cert"), getattr(args, f"{protocol}_server_key")
    root = getattr(args, f"{protocol}_root_cert") or None
    if not cert or not key:
        raise ValueError(f"--{protocol}-use-ssl needs --{protocol}-server-cert and --{protocol}-server-key")
    if mutual and not root:
        raise ValueError(f"--{protocol}-use-ssl-mutual needs --{protocol}-root-cert (the CA client certificates "
                         f"must chain to)")
    for path in (cert, key, root):
        if path and not os.path.isfile(path):
            raise ValueError(f"TLS file not found: {path}")
    settings = TlsSettings(cert, key, root, mutual)
    settings.context()  # refuse a certificate that does not load, or a key that does not match it, at start
    return settings


def tls_from_args(args: argparse.Namespace) -> tuple[TlsSettings | None, TlsSettings | None, TlsSettings | None]:
    """gRPC's, HTTP's and metrics' TLS settings (None: cleartext); ValueError naming what is missing or wrong."""
    grpc_tls, http_tls = _settings(args, "grpc"), _settings(args, "http")
    metrics_tls = None
    if getattr(args, "metrics_use_ssl", False):
        if http_tls is None:
            raise ValueError("--metrics-use-ssl uses the HTTP certificate: set --http-use-ssl and --http-server-*")
        metrics_tls = TlsSettings(http_tls.cert, http_tls.key)
    return grpc_tls, http_tls, metrics_tls
