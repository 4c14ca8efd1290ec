"""Triton's checksum repository agent (server/core/repository_agents.py): a model whose config lists MD5 digests of
its files loads only while the files have them; a mismatch, a malformed entry or a file outside the model directory
fails the load naming it, and the server serves on. A real server, the stock tritonclient."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import tritonclient.http as httpclient
from onnx import TensorProto
from tritonclient.utils import InferenceServerException

from server.core.errors import ServerError
from server.core.model_config import parse_config_text
from server.core.repository_agents import run_agents

from .conftest import examples, run_server

CONFIG = 'name: "{name}"\nmax_batch_size: 8\nmodel_repository_agents {{ agents [{{ name: "checksum" parameters {{ ' \
         'key: "MD5:1/model.onnx" value: "{digest}" }} }}] }}\n'


def _write(repo: Path, name: str, digest: str | None = None) -> Path:
    directory = examples.write_model(repo, name, examples.add_sub_model(TensorProto.INT32))
    actual = hashlib.md5((directory / "1" / "model.onnx").read_bytes()).hexdigest()
    (directory / "config.pbtxt").write_text(CONFIG.format(name=name, digest=digest or actual))
    return directory


def test_the_checksum_agent_checks_each_listed_file(tmp_path: Path) -> None:
    directory = _write(tmp_path, "m")
    config = parse_config_text((directory / "config.pbtxt").read_text(), "m")
    run_agents(config, directory)  # the digest matches
    (directory / "1" / "model.onnx").write_bytes(b"changed")
    with pytest.raises(ServerError, match=r"'1/model.onnx' has MD5 [0-9a-f]{32}, the config expects [0-9a-f]{32}"):
        run_agents(config, directory)
    for key, words in (("SHA1:1/model.onnx", "expected '<algorithm>:<file>'"), ("MD5:", "expected '<algorithm>"),
                       ("MD5:../m/1/model.onnx", "must be relative"), ("MD5:2/model.onnx", "is not a file")):
        bad = parse_config_text(CONFIG.format(name="m", digest="0" * 32).replace("MD5:1/model.onnx", key), "m")
        with pytest.raises(ServerError, match=words):
            run_agents(bad, directory)


def test_a_model_loads_only_while_its_files_have_their_digests(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    _write(repo, "checked")
    _write(repo, "stale", digest="0" * 32)
    with run_server(repo, tmp_path / "server.log", ["checked"]) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        assert client.is_model_ready("checked")
        with pytest.raises(InferenceServerException, match=r"model 'stale': checksum agent parameter "
                                                           r"'MD5:1/model.onnx': '1/model.onnx' has MD5"):
            client.load_model("stale")
        assert client.is_model_ready("checked")  # the server serves on
