"""Repository API confinement and restricted APIs over HTTP, plus the pure parts (specs, groups, names)."""

from __future__ import annotations

import argparse
import asyncio
import base64

import pytest

from server.auth import add_auth_arguments, grpc_group, http_group, parse_restricted_api, restrictions_from_args
from server.core import CoreOptions, ServerCore, ServerError
from server.core.limits import check_load_request, check_model_name

from .conftest import ADMIN, GOOD_BODY, assert_error


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize("path", ["/v2/repository/index", "/v2/repository/models/add_sub/load",
                                  "/v2/repository/models/add_sub/unload"])
def test_repository_needs_the_key(http, path):
    assert_error(http.post(path), 403, "This API is restricted, expecting header 'admin-key'")  # Triton's 403
    assert_error(http.post(path, headers={"admin-key": "s3cre"}), 403, "restricted")
    assert_error(http.post(path, headers={"Admin-Key": "S3CRET"}), 403, "restricted")


def test_config_needs_the_key_other_apis_stay_open(http):
    assert_error(http.get("/v2/models/add_sub/config"), 403, "model-config")
    assert_error(http.get("/v2/models/add_sub/versions/1/config"), 403, "model-config")
    assert http.get("/v2/models/add_sub/config", headers=ADMIN).json()["name"] == "add_sub"
    assert http.get("/v2/health/ready").status_code == 200
    assert http.get("/v2/models/add_sub").json()["name"] == "add_sub"
    assert http.get("/v2/models/add_sub/stats").status_code == 200
    assert http.post("/v2/models/add_sub/infer", json=GOOD_BODY).status_code == 200
    index = http.post("/v2/repository/index", headers=ADMIN).json()
    assert {m["name"] for m in index} >= {"add_sub", "identity", "slow"}


@pytest.mark.parametrize("name, parameters, fragment", [
    ("..", {}, "invalid model name"),
    ("-rf", {}, "invalid model name"),
    ("a" * 256, {}, "invalid model name"),
    ("ok", {"config": "{}", "file:../outside.onnx": _b64(b"x")}, "without '..'"),
    ("ok", {"config": "{}", "file:1/../../outside.onnx": _b64(b"x")}, "without '..'"),
    ("ok", {"config": "{}", "file:/tmp/abs.onnx": _b64(b"x")}, "leading '/'"),
    ("ok", {"config": "{}", "file:C:/x.onnx": _b64(b"x")}, "a drive"),
    ("ok", {"config": "{}", "file:1\\..\\..\\x": _b64(b"x")}, "without '..'"),
    ("ok", {"config": "{}", "file:1//model.onnx": _b64(b"x")}, "without '..'"),
    ("ok", {"config": "{}", "file:": _b64(b"x")}, "without '..'"),
    ("ok", {"config": {"output": [{"name": "o", "label_filename": "/etc/passwd"}]}}, "config file name"),
    ("add_sub", {"config": {"default_model_filename": "../../../../../../etc/hostname"}}, "config file name"),
    ("add_sub", {"config": "[" * 5000}, "not valid JSON"),
])
def test_load_requests_that_would_leave_the_model_directory(http, guarded_server, name, parameters, fragment):
    before = sorted(p.name for p in guarded_server.repository.iterdir())
    response = http.post(f"/v2/repository/models/{name}/load", json={"parameters": parameters}, headers=ADMIN)
    if name == "..":  # the URL normalizes away: no such route
        assert response.status_code == 404
    else:
        assert_error(response, 400, fragment)
    assert sorted(p.name for p in guarded_server.repository.iterdir()) == before
    assert http.post("/v2/models/add_sub/infer", json=GOOD_BODY).status_code == 200


def test_uploaded_label_file_is_plain_bytes_inside_the_model(http):
    """Uploads are plain files: a 'symlink' in an upload is just its bytes, so nothing outside can be named."""
    import onnx

    from tests.server.conftest import examples

    model = examples.add_sub_model(onnx.TensorProto.INT32).SerializeToString()
    config = {"name": "uploaded", "max_batch_size": 8,
              "output": [{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [16], "label_filename": "labels.txt"}]}
    parameters = {"config": config, "file:1/model.onnx": _b64(model), "file:labels.txt": _b64(b"/etc/passwd")}
    response = http.post("/v2/repository/models/uploaded/load", json={"parameters": parameters}, headers=ADMIN)
    assert response.status_code == 200, response.text
    body = {**GOOD_BODY, "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 1}}]}
    top = http.post("/v2/models/uploaded/infer", json=body).json()["outputs"][0]["data"]
    assert top == ["16.000000:15"], top  # labels.txt has one line (the text "/etc/passwd"): index 15 has no label
    assert http.post("/v2/repository/models/uploaded/unload", headers=ADMIN).status_code == 200


def test_model_control_mode_none_refuses_repository_changes(tmp_path):
    (tmp_path / "empty").mkdir()
    core = ServerCore(CoreOptions([str(tmp_path / "empty")], model_control_mode="none"))

    async def attempt() -> list[str]:
        kinds = []
        for call in (core.load_model("m"), core.unload_model("m")):
            try:
                await call
            except ServerError as e:
                kinds.append(e.kind.name)
        return kinds

    assert asyncio.run(attempt()) == ["UNAVAILABLE", "UNAVAILABLE"]


def test_restricted_api_specs():
    api = parse_restricted_api(["model-repository,model-config:Admin-Key=v=1", "inference:token=t"])
    api.check("health", {})
    api.check("model-config", {"admin-key": "v=1"})
    with pytest.raises(ServerError) as info:
        api.check("model-config", {"admin-key": "v=2"})
    assert info.value.kind.name == "UNAVAILABLE" and info.value.http_status == 403  # Triton's gRPC / HTTP statuses
    with pytest.raises(ServerError):
        api.check("inference", {"admin-key": "v=1"})
    for bad in ["model-repository", "model-repository:key", "nope:k=v", ":k=v", "inference:=v"]:
        with pytest.raises(ValueError):
            parse_restricted_api([bad])
    with pytest.raises(ValueError, match="more than once"):
        parse_restricted_api(["inference:a=1", "inference,trace:b=2"])
    parser = argparse.ArgumentParser()
    add_auth_arguments(parser)
    for flag in ("--grpc-restricted-protocol", "--grpc-restricted-api"):  # Triton's name, and ours before it
        http_api, grpc_api = restrictions_from_args(parser.parse_args([flag, "logging:k=v"]))
        assert not http_api and grpc_api.restrictions[0].groups == {"logging"}
        assert grpc_api.header("logging") == "triton-grpc-protocol-k" and grpc_api.header("health") == ""
        grpc_api.check("logging", {"triton-grpc-protocol-k": "v"})
        with pytest.raises(ServerError):
            grpc_api.check("logging", {"k": "v"})
    with pytest.raises(SystemExit):
        parser.parse_args(["--http-restricted-api", "bogus:k=v"])


@pytest.mark.parametrize("path, group", [
    ("/v2/health/live", "health"), ("/v2/models/m/ready", "health"), ("/v2/models/m/versions/2/ready", "health"),
    ("/v2", "metadata"), ("/v2/models/m", "metadata"), ("/v2/models/m/versions/1", "metadata"),
    ("/v2/models/m/infer", "inference"), ("/v2/models/m/versions/1/infer", "inference"),
    ("/v2/models/m/config", "model-config"), ("/v2/models/stats", "statistics"), ("/v2/models/m/stats", "statistics"),
    ("/v2/repository/index", "model-repository"), ("/v2/repository/models/m/load", "model-repository"),
    ("/v2/systemsharedmemory/status", "shared-memory"), ("/v2/cudasharedmemory/region/r/register", "shared-memory"),
    ("/v2/trace/setting", "trace"), ("/v2/models/m/trace/setting", "trace"), ("/v2/logging", "logging"),
    ("/v2/models/infer/config", "model-config"), ("/v2/models/config/infer", "inference"),
])
def test_http_groups(path, group):
    assert http_group(path) == group


def test_grpc_groups():
    assert grpc_group("/inference.GRPCInferenceService/ModelInfer") == "inference"
    assert grpc_group("/inference.GRPCInferenceService/RepositoryModelLoad") == "model-repository"
    assert grpc_group("/grpc.health.v1.Health/Check") == "health"
    assert grpc_group("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") == "metadata"


def test_names_and_uploads_unit():
    for good in ["add_sub", "m.v2", "A-1", "x" * 255]:
        check_model_name(good)
    for bad in ["", ".x", "-x", "a/b", "a\\b", "a b", "é", "a\x00"]:
        with pytest.raises(ServerError):
            check_model_name(bad)
    check_load_request("m", '{"output": [{"label_filename": "sub/labels.txt"}]}', {"file:1/model.onnx": b""})
    with pytest.raises(ServerError):
        check_load_request("m", None, {f"file:{i}": b"" for i in range(1025)})
    with pytest.raises(ServerError):
        check_load_request("m", None, {"file:" + "/".join(["d"] * 17): b""})
