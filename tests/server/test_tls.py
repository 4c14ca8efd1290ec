"""TLS and mutual TLS on the gRPC and HTTP listeners, with Triton's `--grpc-use-ssl*` flags, the stock tritonclient's
SSL options, certificates made here (a CA, a server certificate for 127.0.0.1, a client certificate), and rotation
on SIGHUP without dropping an open connection.
"""

from __future__ import annotations

import datetime
import signal
import ssl
import time
from pathlib import Path

import numpy as np
import pytest

from tests.server.conftest import examples, run_server

x509 = pytest.importorskip("cryptography.x509")
grpc = pytest.importorskip("grpc")
grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402 - after the importorskip above
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _certificate(subject: str, issuer_key, issuer_name: x509.Name, key, *, ca: bool = False,
                 server: bool = False, serial: int | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(serial or x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        import ipaddress

        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, certificate: x509.Certificate | None = None, key=None) -> str:
    if certificate is not None:
        path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    """A CA and, signed by it, a server certificate for 127.0.0.1/localhost and a client certificate (PEM files)."""
    base = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("kiln test CA", ca_key, _name("kiln test CA"), ca_key, ca=True)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    files = {
        "ca": _write(base / "ca.pem", ca),
        "server_cert": _write(base / "server.pem", _certificate("server", ca_key, ca.subject, server_key,
                                                                server=True, serial=1001)),
        "server_key": _write(base / "server.key", key=server_key),
        "client_cert": _write(base / "client.pem", _certificate("client", ca_key, ca.subject, client_key)),
        "client_key": _write(base / "client.key", key=client_key),
    }
    files["_ca_key"], files["_ca"], files["_server_key"], files["_base"] = ca_key, ca, server_key, base
    return files


def _flags(pki: dict, protocol: str, mutual: bool) -> list[str]:
    flags = [f"--{protocol}-use-ssl", "true", f"--{protocol}-server-cert", pki["server_cert"],
             f"--{protocol}-server-key", pki["server_key"]]
    if mutual:
        flags += [f"--{protocol}-use-ssl-mutual", "true", f"--{protocol}-root-cert", pki["ca"]]
    return flags


def _add_sub(client_module, client) -> np.ndarray:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [client_module.InferInput("INPUT0", [1, 16], "INT32"), client_module.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    return client.infer("add_sub", inputs).as_numpy("OUTPUT0")


def _grpc_client(server, pki: dict, with_cert: bool):
    options = {"root_certificates": pki["ca"]}
    if with_cert:
        options.update(private_key=pki["client_key"], certificate_chain=pki["client_cert"])
    return grpcclient.InferenceServerClient(server.grpc_url, ssl=True, **options)


def _client_context(pki: dict, with_cert: bool = True) -> ssl.SSLContext:
    """What an HTTPS client trusts (the test CA) and, for mutual TLS, presents (the client certificate)."""
    context = ssl.create_default_context(cafile=pki["ca"])
    if with_cert:
        context.load_cert_chain(pki["client_cert"], pki["client_key"])
    return context


def _server_serial(port: int, pki: dict) -> int:
    """The serial number of the certificate the server presents to a new connection now."""
    context = _client_context(pki)
    import socket

    with socket.create_connection(("127.0.0.1", port)) as raw, context.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        return x509.load_der_x509_certificate(s.getpeercert(binary_form=True)).serial_number


@pytest.mark.parametrize("frontends", ["0", "2"])  # 2: gRPC connections handed over by the server process
def test_grpc_and_http_over_tls_refuse_plaintext(tmp_path: Path, pki: dict, frontends: str) -> None:
    repository = examples.make_repository(tmp_path / "models")
    probe = {"verify": _client_context(pki, False)}
    with run_server(repository, tmp_path / "server.log", ["add_sub"],
                    [*_flags(pki, "grpc", False), *_flags(pki, "http", False), "--metrics-use-ssl", "true",
                     "--frontend-processes", frontends], http_client=probe) as server:
        with _grpc_client(server, pki, with_cert=False) as client:
            assert client.is_server_ready()
            np.testing.assert_array_equal(_add_sub(grpcclient, client), 2 * np.arange(16).reshape(1, 16))
        with grpcclient.InferenceServerClient(server.grpc_url) as plain:  # a cleartext client is refused
            with pytest.raises(InferenceServerException):
                plain.is_server_live(client_timeout=5)
        client = httpclient.InferenceServerClient(server.http_url, ssl=True, ssl_options={"ca_certs": pki["ca"]})
        try:
            assert client.is_server_ready()
            np.testing.assert_array_equal(_add_sub(httpclient, client), 2 * np.arange(16).reshape(1, 16))
        finally:
            client.close()
        import httpx

        with pytest.raises((httpx.HTTPError, OSError)):  # refused in the handshake (a reset surfaces raw)
            httpx.get(f"http://{server.http_url}/v2/health/live", timeout=5)
        metrics = httpx.get(server.metrics_url.replace("http://", "https://"), verify=_client_context(pki, False),
                            timeout=5)
        assert metrics.status_code == 200 and "nv_inference_request_success" in metrics.text


def test_mutual_tls_needs_a_client_certificate_and_certificates_rotate_on_sighup(tmp_path: Path, pki: dict) -> None:
    repository = examples.make_repository(tmp_path / "models")
    probe = {"verify": _client_context(pki)}
    # the server reads its own copy of the certificate files, which the test rotates
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    cert.write_bytes(Path(pki["server_cert"]).read_bytes())
    key.write_bytes(Path(pki["server_key"]).read_bytes())
    rotating = {**pki, "server_cert": str(cert), "server_key": str(key)}
    with run_server(repository, tmp_path / "server.log", ["add_sub"],
                    [*_flags(rotating, "grpc", True), *_flags(rotating, "http", True)], http_client=probe) as server:
        with _grpc_client(server, pki, with_cert=False) as anonymous:
            with pytest.raises(InferenceServerException):
                anonymous.is_server_live(client_timeout=5)
        import httpx

        with pytest.raises((httpx.HTTPError, OSError)):  # refused in the handshake (a reset surfaces raw)
            httpx.get(f"https://{server.http_url}/v2/health/live", verify=_client_context(pki, False), timeout=5)
        with _grpc_client(server, pki, with_cert=True) as client:
            np.testing.assert_array_equal(_add_sub(grpcclient, client), 2 * np.arange(16).reshape(1, 16))
            assert _server_serial(server.grpc_port, pki) == 1001
            # rotate: a new server certificate (serial 2002) for the same key, then SIGHUP
            cert.write_bytes(_certificate("server", pki["_ca_key"], pki["_ca"].subject, pki["_server_key"],
                                          server=True, serial=2002).public_bytes(serialization.Encoding.PEM))
            server.process.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and (_server_serial(server.grpc_port, pki) != 2002
                                                    or _server_serial(server.http_port, pki) != 2002):
                time.sleep(0.2)
            assert _server_serial(server.grpc_port, pki) == 2002 and _server_serial(server.http_port, pki) == 2002
            # the connection opened before the rotation is still serving
            np.testing.assert_array_equal(_add_sub(grpcclient, client), 2 * np.arange(16).reshape(1, 16))
        assert httpx.get(f"https://{server.http_url}/v2/health/ready", verify=_client_context(pki),
                         timeout=5).status_code == 200


def test_tls_flags_are_checked_at_start(tmp_path: Path, pki: dict) -> None:
    import argparse

    from server.cli import add_serve_arguments
    from server.tls import tls_from_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)

    def settings(*flags: str):
        return tls_from_args(parser.parse_args(["--model-repository", str(tmp_path), *flags]))

    assert settings() == (None, None, None)
    with pytest.raises(ValueError, match="--grpc-server-cert"):
        settings("--grpc-use-ssl", "true")
    with pytest.raises(ValueError, match="--http-root-cert"):
        settings(*_flags(pki, "http", False), "--http-use-ssl-mutual", "true")
    with pytest.raises(ValueError, match="not found"):
        settings("--grpc-use-ssl", "true", "--grpc-server-cert", str(tmp_path / "nope.pem"),
                 "--grpc-server-key", pki["server_key"])
    with pytest.raises(ValueError, match="--metrics-use-ssl"):
        settings("--metrics-use-ssl", "true")
    with pytest.raises(ssl.SSLError):  # a key that is not the certificate's
        settings("--grpc-use-ssl", "true", "--grpc-server-cert", pki["server_cert"],
                 "--grpc-server-key", pki["client_key"])
    grpc_tls, http_tls, metrics_tls = settings(*_flags(pki, "grpc", True), *_flags(pki, "http", False),
                                               "--metrics-use-ssl", "true")
    assert grpc_tls.mutual and grpc_tls.root == pki["ca"] and not http_tls.mutual
    assert metrics_tls.cert == pki["server_cert"]
