"""tritonserver's command line on `kiln serve` (server/triton_flags.py and the flags honoured in server/cli.py): a flag
Kiln does not implement is refused before anything starts, naming it and what to do, unless its value is what Kiln
does anyway; --exit-on-error, --id, --model-config-name, --model-load-thread-count, --log-info/warning/error,
--exit-timeout-secs and the older --trace-* flags do what Triton's do. Real servers on localhost, stock tritonclient."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto

from load_tests import harness
from server import repository
from server.cli import add_serve_arguments
from server.repository import read_source
from server.trace_flags import trace_settings
from server.triton_flags import REFUSED, check_triton_flags
from tests.support.servers import FRONTENDS

from .conftest import examples, run_server
from .test_ensemble import CHAIN, ensemble_config

ADD_SUB = 'name: "{name}"\nmax_batch_size: {batch}\ndynamic_batching {{ }}\n'


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(["--model-repository", "/nowhere", *flags])


@pytest.mark.parametrize("flags, message", [
    (["--rate-limit", "execution_count"], "--rate-limit=execution_count: Kiln does not implement this Triton flag "
                                          "(accepted: off): Kiln has no rate limiter"),
    (["--disable-auto-complete-config"], "--disable-auto-complete-config: Kiln does not implement this Triton flag: "
                                         "Kiln completes a config from its model"),
    (["--http-thread-count", "16"], "from --frontend-processes N processes"),
    (["--allow-sagemaker", "true"], "--allow-sagemaker=true: Kiln does not implement this Triton flag (accepted: "
                                    "false): Kiln has no SageMaker endpoint"),
    (["--backend-config", "python,shm-default-byte-size=1000"], "each model's config.pbtxt parameters"),
])
def test_a_triton_flag_kiln_does_not_implement_is_refused_naming_it(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError) as refused:
        check_triton_flags(_args(*flags))
    assert message in str(refused.value)


def test_a_triton_flag_at_what_kiln_does_anyway_is_accepted() -> None:
    check_triton_flags(_args("--rate-limit", "off", "--allow-sagemaker", "0", "--enable-peer-access", "true",
                             "--model-load-retry-count", "0", "--strict-model-config", "false",
                             "--grpc-infer-response-compression-level", "NONE"))
    assert all(name.startswith("--") for name in REFUSED)


def test_older_trace_flags_become_trace_config_settings_that_trace_config_overrides() -> None:
    args = _args("--trace-file", "/tmp/t.json", "--trace-level", "TIMESTAMPS", "--trace-level", "TENSORS",
                 "--trace-rate", "5", "--trace-count", "10", "--trace-log-frequency", "2", "--trace-config", "rate=7")
    assert trace_settings(args) == ["triton,file=/tmp/t.json", "level=TIMESTAMPS", "level=TENSORS", "rate=5",
                                    "count=10", "triton,log-frequency=2", "rate=7"]


def test_exit_timeout_secs_is_the_drain_timeout() -> None:
    assert _args("--exit-timeout-secs", "7").drain_timeout == 7.0


def test_a_custom_config_name_reads_configs_name_pbtxt_where_a_model_has_one(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "m"
    (model / "configs").mkdir(parents=True)
    (model / "config.pbtxt").write_text("max_batch_size: 8")
    (model / "configs" / "h100.pbtxt").write_text("max_batch_size: 64")
    monkeypatch.setattr(repository, "_config_name", "")
    repository.configure_config_name("h100")
    assert read_source("m", model).config_text == "max_batch_size: 64"
    repository.configure_config_name("a100")  # this model has none of that name: its config.pbtxt
    assert read_source("m", model).config_text == "max_batch_size: 8"
    with pytest.raises(ValueError, match="without spaces or path separators"):
        repository.configure_config_name("../etc")


def _write_add_sub(repo: Path, name: str, batch: int = 8) -> Path:
    examples.write_model(repo, name, examples.add_sub_model(TensorProto.INT32), ADD_SUB.format(name=name, batch=batch))
    return repo / name


def test_a_model_that_fails_at_start_ends_the_server_unless_exit_on_error_is_false(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    _write_add_sub(repo, "good")
    broken = repo / "broken" / "1"
    broken.mkdir(parents=True)
    (broken / "model.onnx").write_bytes(b"not an onnx file")
    ports = harness.free_ports(3)
    log = tmp_path / "exit.log"
    process = harness.start(harness.kiln_command(repo, ports, *FRONTENDS), log, env=harness.python_path_env())
    try:
        code = process.wait(120)
    finally:
        harness.stop(process)
    text = log.read_text()
    assert code == 1, text[-2000:]
    assert "failed to load all models (broken: " in text and "--exit-on-error false" in text
    with run_server(repo, tmp_path / "kept.log", ["good", "broken"], ["--exit-on-error", "false",
                                                                      "--strict-readiness", "false"]) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        assert client.is_model_ready("good") and not client.is_model_ready("broken")


def test_id_config_name_load_thread_count_and_log_levels_are_honoured(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    for name in ("add_sub", "other"):
        directory = _write_add_sub(repo, name)
        (directory / "configs").mkdir()
        (directory / "configs" / "big.pbtxt").write_text(ADD_SUB.format(name=name, batch=32))
    (repo / "ens" / "1").mkdir(parents=True)
    (repo / "ens" / "config.pbtxt").write_text(ensemble_config("ens", CHAIN, inputs=None))
    flags = ["--id", "edge-7", "--model-config-name", "big", "--model-load-thread-count", "1", "--log-info", "false",
             "--metrics-address", "127.0.0.2"]
    with run_server(repo, tmp_path / "server.log", None, flags) as server:  # one load at a time, an ensemble too
        assert httpx.get(f"{server.base_url}/v2").json()["name"] == "edge-7"
        assert httpx.get(f"http://127.0.0.2:{server.metrics_port}/metrics").status_code == 200
        with pytest.raises(httpx.ConnectError):  # only there, not on --http-address
            httpx.get(server.metrics_url)
        client = httpclient.InferenceServerClient(server.http_url)
        assert client.get_model_config("add_sub")["max_batch_size"] == 32  # configs/big.pbtxt
        assert client.is_model_ready("ens") and client.is_model_ready("other")
        time.sleep(0.2)
        assert not re.search(r"^I\d{4} ", server.log(), re.MULTILINE) and "serving: HTTP" not in server.log()  # no info


def test_kiln_serve_refuses_a_triton_flag_before_starting(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "server", "--model-repository", str(tmp_path), "--rate-limit",
                           "execution_count", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 2 and "--rate-limit=execution_count: Kiln does not implement this Triton flag" in (
        done.stderr + done.stdout)


def test_frontend_processes_log_at_the_levels_the_flags_leave_on() -> None:
    import logging

    from server.frontend_processes import frontend_log_level

    assert frontend_log_level(_args()) == logging.WARNING  # frontends: warnings and errors by default
    assert frontend_log_level(_args("--log-verbose", "1")) == logging.INFO
    assert frontend_log_level(_args("--log-verbose", "1", "--log-info", "false")) == logging.WARNING
    assert frontend_log_level(_args("--log-warning", "false")) == logging.ERROR
    assert frontend_log_level(_args("--log-warning", "false", "--log-error", "false")) > logging.CRITICAL

