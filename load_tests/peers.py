"""Peer servers side by side with Kiln: same ONNX models, same client (`kiln perf`), same machine.

    python -m load_tests.peers setup                  # MLServer and KServe (+ onnxruntime), each in its own venv
    python -m load_tests.peers repo /tmp/kiln-bench   # the benchmark models, in each server's layout
    python -m load_tests.peers start kserve /tmp/kiln-bench   # serve one (Ctrl-C stops it)
    python -m load_tests.peers bench                  # every scenario, every server -> bench/results/serving_*.json
    python -m load_tests.peers bench --only add_sub_http_json add_sub_grpc   # Kiln vs Triton, 3 alternating rounds

Peers run from their own venvs so their dependencies never mix with Kiln's; a peer whose venv is missing is
skipped with a note. Kiln and MLServer listen on 127.0.0.1 only; KServe's Python server hard-codes 0.0.0.0
(HTTP) and [::] (gRPC), and Triton listens on every address (../shared/tools/triton-peer/serve.sh has no
address flag). MLServer and KServe serve the ONNX files through onnxruntime in their documented custom-model
way (load_tests/peer_runtimes/). Triton is the real Triton Inference Server (C++ core, Python backend, from
the nvidia-pytriton wheel) serving add_sub FP32 [16] with dynamic batching (max batch 8, 100 us); Kiln serves
the same add_sub as ONNX Add/Sub with the same batching, on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import onnx
from onnx import TensorProto, helper

from load_tests import harness, perf

ROOT = Path(__file__).resolve().parents[1]
RUNTIMES = Path(__file__).resolve().parent / "peer_runtimes"
RESULTS = ROOT / "bench" / "results"
MLSERVER_VENV = Path("/tmp/peer-mlserver")
MLSERVER_PACKAGES = ["mlserver==1.7.1", "onnxruntime", "numpy", "uvloop<0.22"]  # uvloop 0.22+ breaks its workers
KSERVE_VENV = Path("/tmp/peers/kserve-venv")
KSERVE_PACKAGES = ["kserve==0.21.0", "onnxruntime", "numpy"]
TRITON_VENV = Path(os.environ.get("PYTRITON_VENV", "/tmp/pytriton-venv"))
TRITON_PACKAGES = ["nvidia-pytriton"]
TRITON_SERVE = Path(os.environ.get("KILN_TRITON_PEER", ROOT.parent / "shared" / "tools" / "triton-peer" / "serve.sh"))
READY_TIMEOUT_S = 90.0
ONE_MB_FLOATS = 262144  # 1 MiB of FP32


# ----------------------------------------------------------------------------------------------- models

def _examples() -> ModuleType:
    """examples/make_example_repository.py, whose model builders the peers serve too."""
    return harness.load_example("make_example_repository.py")


def trivial_model() -> onnx.ModelProto:
    """OUTPUT = INPUT + 1 on FP32 [1, 16]: next to no compute, so req/s and latency measure the serving path."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT", "one"], ["OUTPUT"], name="add")], "trivial",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, [1, 16])], initializer=[one])
    return _examples()._model(graph)


def identity_model() -> onnx.ModelProto:
    """OUTPUT = INPUT on FP32 [n]: the payload is all there is (binary vs JSON on 1 MB tensors)."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT"], ["OUTPUT"], name="identity")], "identity_fp32",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, ["n"])])
    return _examples()._model(graph)


@dataclass(frozen=True)
class BenchModel:
    name: str
    model: onnx.ModelProto
    inputs: list[tuple[str, list[int]]]  # fixed shapes the client sends (MLServer metadata)
    outputs: list[tuple[str, list[int]]]


def bench_models() -> list[BenchModel]:
    return [
        BenchModel("trivial", trivial_model(), [("INPUT", [1, 16])], [("OUTPUT", [1, 16])]),
        BenchModel("simple_cnn", _examples().cnn_model(), [("INPUT", [1, 3, 32, 32])], [("PROBABILITIES", [1, 10])]),
        # fixed 1 MiB dims in the config: Kiln's profile for a -1 dim stops at 4096 (server/core/model.py)
        BenchModel("identity_fp32", identity_model(), [("INPUT", [ONE_MB_FLOATS])], [("OUTPUT", [ONE_MB_FLOATS])]),
    ]


def _kiln_config(m: BenchModel) -> str:
    """No batching (max_batch_size 0): Kiln and MLServer get the very same tensors."""
    def tensors(items: list[tuple[str, list[int]]]) -> str:
        return ",\n".join(f'  {{ name: "{n}" data_type: TYPE_FP32 dims: [ {", ".join(map(str, s))} ] }}'
                          for n, s in items)
    return (f'name: "{m.name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
            f"input [\n{tensors(m.inputs)}\n]\noutput [\n{tensors(m.outputs)}\n]\n")


def _mlserver_settings(m: BenchModel) -> dict:
    def tensors(items: list[tuple[str, list[int]]]) -> list[dict]:
        return [{"name": n, "datatype": "FP32", "shape": s} for n, s in items]
    return {"name": m.name, "implementation": "mlserver_onnx.OnnxModel", "parameters": {"uri": "./model.onnx"},
            "inputs": tensors(m.inputs), "outputs": tensors(m.outputs)}


def _kserve_io(m: BenchModel) -> dict:
    """The tensor metadata KServe's v2 metadata endpoint reports (`kserve_onnx.OnnxModel.get_input_types`)."""
    settings = _mlserver_settings(m)
    return {"inputs": settings["inputs"], "outputs": settings["outputs"]}


def write_repository(directory: Path) -> Path:
    """`<dir>/kiln/<model>/1/model.onnx + config.pbtxt`, `<dir>/mlserver/<model>/model.onnx + model-settings.json`
    and `<dir>/kserve/<model>/model.onnx + io.json`: the same ONNX bytes for every server."""
    for m in bench_models():
        kiln_dir = directory / "kiln" / m.name
        (kiln_dir / "1").mkdir(parents=True, exist_ok=True)
        onnx.save(m.model, kiln_dir / "1" / "model.onnx")
        (kiln_dir / "config.pbtxt").write_text(_kiln_config(m))
        ml_dir = directory / "mlserver" / m.name
        ml_dir.mkdir(parents=True, exist_ok=True)
        onnx.save(m.model, ml_dir / "model.onnx")
        (ml_dir / "model-settings.json").write_text(json.dumps(_mlserver_settings(m), indent=2))
        ks_dir = directory / "kserve" / m.name
        ks_dir.mkdir(parents=True, exist_ok=True)
        onnx.save(m.model, ks_dir / "model.onnx")
        (ks_dir / "io.json").write_text(json.dumps(_kserve_io(m), indent=2))
    write_add_sub(directory)
    return directory


ADD_SUB_MAX_BATCH = 8
ADD_SUB_DELAY_US = 100


def _add_sub_kiln_config() -> str:
    """Triton's add_sub config (../shared/tools/triton-peer/triton_repo) for Kiln's ONNX add_sub, on the CPU."""
    tensors = lambda names: ", ".join(f'{{ name: "{n}" data_type: TYPE_FP32 dims: [ 16 ] }}' for n in names)  # noqa: E731
    return (f'name: "add_sub"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {ADD_SUB_MAX_BATCH}\n'
            f"input [ {tensors(('INPUT0', 'INPUT1'))} ]\noutput [ {tensors(('OUTPUT0', 'OUTPUT1'))} ]\n"
            "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
            f"dynamic_batching {{ max_queue_delay_microseconds: {ADD_SUB_DELAY_US} }}\n")


def _add_sub_mlserver_settings() -> dict:
    """The same model for MLServer, with its adaptive batching set like the dynamic batcher."""
    tensors = lambda names: [{"name": n, "datatype": "FP32", "shape": [-1, 16]} for n in names]  # noqa: E731
    return {"name": "add_sub", "implementation": "mlserver_onnx.OnnxModel", "parameters": {"uri": "./model.onnx"},
            "inputs": tensors(("INPUT0", "INPUT1")), "outputs": tensors(("OUTPUT0", "OUTPUT1")),
            "max_batch_size": ADD_SUB_MAX_BATCH, "max_batch_time": ADD_SUB_DELAY_US / 1e6}


def write_add_sub(directory: Path) -> None:
    """add_sub FP32 for Kiln and MLServer (Triton serves its own Python-backend add_sub from serve.sh)."""
    model = _examples().add_sub_model(TensorProto.FLOAT)
    kiln_dir = directory / "kiln" / "add_sub"
    (kiln_dir / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(model, kiln_dir / "1" / "model.onnx")
    (kiln_dir / "config.pbtxt").write_text(_add_sub_kiln_config())
    ml_dir = directory / "mlserver" / "add_sub"
    ml_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(model, ml_dir / "model.onnx")
    (ml_dir / "model-settings.json").write_text(json.dumps(_add_sub_mlserver_settings(), indent=2))


# ----------------------------------------------------------------------------------------------- servers

@dataclass
class Server:
    """A server subprocess on 127.0.0.1 with its ports; `running()` starts it and stops it afterwards."""

    name: str
    command: list[str]
    http_port: int
    grpc_port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    version: str = ""

    @contextmanager
    def running(self) -> Iterator[Server]:
        with harness.serving(self.command, self.log_path,
                             harness.http_ready(f"http://127.0.0.1:{self.http_port}/v2/health/ready"),
                             env={**os.environ, **self.env}, timeout_s=READY_TIMEOUT_S, interval_s=0.3,
                             stop_timeout_s=20, name=self.name, show_log=False):
            yield self


def kiln_server(repo: Path, logs: Path) -> Server:
    return kiln_server_on(repo / "kiln", logs)


def kiln_server_on(repository: Path, logs: Path) -> Server:
    """`python -m server` of this checkout on `repository` (a Kiln/Triton model repository), on free ports."""
    ports = harness.free_ports(3)
    command = harness.kiln_command(repository, ports)
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return Server("kiln", command, ports[0], ports[1], logs / "kiln.log", env, _kiln_version())


def _kiln_version() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return f"kiln git {out.stdout.strip()} (+ working tree)"
    except OSError:
        return "kiln"


def mlserver_server(repo: Path, logs: Path, venv: Path = MLSERVER_VENV) -> Server:
    """MLServer 1.x with its defaults (one parallel inference worker process), ports in settings.json."""
    ports = harness.free_ports(3)
    settings = {"host": "127.0.0.1", "http_port": ports[0], "grpc_port": ports[1], "metrics_port": ports[2],
                "debug": False}
    (repo / "mlserver" / "settings.json").write_text(json.dumps(settings, indent=2))
    env = {"PYTHONPATH": str(RUNTIMES)}
    version = subprocess.run([str(venv / "bin" / "python"), "-c", "import mlserver, onnxruntime as o; "
                              "print(f'mlserver {mlserver.__version__}, onnxruntime {o.__version__}')"],
                             capture_output=True, text=True).stdout.strip()
    return Server("mlserver", [str(venv / "bin" / "mlserver"), "start", str(repo / "mlserver")], ports[0],
                  ports[1], logs / "mlserver.log", env, version)


def kserve_server(repo: Path, logs: Path, venv: Path = KSERVE_VENV) -> Server:
    """KServe's Python model server (`kserve.ModelServer`) with its defaults: one HTTP worker (uvicorn + uvloop),
    gRPC on, access log and per-request latency logging on."""
    ports = harness.free_ports(2)
    command = [str(venv / "bin" / "python"), str(RUNTIMES / "kserve_onnx.py"), "--model_dir", str(repo / "kserve"),
               "--http_port", str(ports[0]), "--grpc_port", str(ports[1])]
    version = subprocess.run([str(venv / "bin" / "python"), "-c", "from importlib.metadata import version as v; "
                              "print(f'kserve {v(\"kserve\")}, onnxruntime {v(\"onnxruntime\")}')"],
                             capture_output=True, text=True).stdout.strip()
    return Server("kserve", command, ports[0], ports[1], logs / "kserve.log", {}, version)


def triton_server(repo: Path, logs: Path, venv: Path = TRITON_VENV) -> Server:
    """tritonserver from the nvidia-pytriton wheel via serve.sh: add_sub (Python backend, KIND_CPU), dynamic
    batching max batch 8 / 100 us; its own repository, so `repo` is unused."""
    ports = harness.free_ports(3)
    version = subprocess.run([str(venv / "bin" / "python"), "-c", "from importlib.metadata import version as v; "
                              "print(f'tritonserver from nvidia-pytriton {v(\"nvidia-pytriton\")}')"],
                             capture_output=True, text=True).stdout.strip()
    return Server("triton", ["bash", str(TRITON_SERVE), *map(str, ports)], ports[0], ports[1], logs / "triton.log",
                  {"PYTRITON_VENV": str(venv)}, version)


PEERS = {"mlserver": (MLSERVER_VENV, MLSERVER_PACKAGES), "kserve": (KSERVE_VENV, KSERVE_PACKAGES),
         "triton": (TRITON_VENV, TRITON_PACKAGES)}
FACTORIES = {"kiln": kiln_server, "mlserver": mlserver_server, "kserve": kserve_server, "triton": triton_server}


def available(name: str) -> str:
    """Why `name` cannot run here ("" when it can): a peer needs its venv (and Triton its serve.sh)."""
    if name == "kiln":
        return ""
    venv = PEERS[name][0]
    if not (venv / "bin" / "python").exists():
        return f"no venv at {venv} (python -m load_tests.peers setup --peers {name})"
    if name == "triton" and not TRITON_SERVE.is_file():
        return f"no {TRITON_SERVE}"
    return ""


def setup_peer(name: str, venv: Path | None = None) -> None:
    """Create the peer's own venv and install it there from PyPI (never into Kiln's venv)."""
    default_venv, packages = PEERS[name]
    venv = venv or default_venv
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "ensurepip", "--upgrade"], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *packages], check=True)


def setup_mlserver(venv: Path = MLSERVER_VENV) -> None:
    setup_peer("mlserver", venv)


# ----------------------------------------------------------------------------------------------- scenarios

@dataclass(frozen=True)
class Scenario:
    """One `kiln perf` run against each of `servers`; results go to bench/results/serving_<name>_<server>.json."""

    name: str
    servers: tuple[str, ...]
    args: tuple[str, ...]
    protocol: str = "http"
    rounds: int = 1  # > 1: the servers take turns, round after round (run N files), so drift hits all alike


COMMON = ("-p", "2000", "--warmup", "1", "-r", "5", "--processes", "2")
ONNX_SERVERS = ("kiln", "mlserver", "kserve")  # those that serve the ONNX bench models
ALL = (*ONNX_SERVERS, "triton")
ADD_SUB = ("-m", "add_sub", "--concurrency-range", "16,64")
SCENARIOS = [
    Scenario("trivial_http_json", ONNX_SERVERS,
             ("-m", "trivial", "--input-tensor-format", "json", "--concurrency-range", "1:16:x2")),
    Scenario("trivial_grpc", ONNX_SERVERS, ("-m", "trivial", "--concurrency-range", "1:16:x2"), "grpc"),
    Scenario("cnn_http_json", ONNX_SERVERS,
             ("-m", "simple_cnn", "--input-tensor-format", "json", "--concurrency-range", "1:16:x2")),
    Scenario("cnn_grpc", ONNX_SERVERS, ("-m", "simple_cnn", "--concurrency-range", "1:16:x2"), "grpc"),
    Scenario("identity1mb_http_binary", ("kiln",),
             ("-m", "identity_fp32", "--concurrency-range", "1:4:x2", "-p", "4000")),
    Scenario("identity1mb_http_json", ("kiln",),
             ("-m", "identity_fp32", "--input-tensor-format", "json",
              "--concurrency-range", "1:4:x2", "-p", "4000")),
    Scenario("add_sub_http_json", ("kiln", "triton", "mlserver"), (*ADD_SUB, "--input-tensor-format", "json"),
             rounds=3),
    Scenario("add_sub_grpc", ("kiln", "triton", "mlserver"), ADD_SUB, "grpc", rounds=3),
]
QUICK = ("-p", "500", "--warmup", "0.3", "-r", "3")  # --quick: a check that the setup works, not a result


def run_scenario(scenario: Scenario, server: Server, out_dir: Path, run: int = 1, quick: bool = False) -> Path:
    """One scenario on one server; repeat runs (`run` > 1) get their own files, so noise between runs shows."""
    port = server.grpc_port if scenario.protocol == "grpc" else server.http_port
    suffix = f"_run{run}" if run > 1 else ""
    out = out_dir / f"serving_{scenario.name}_{server.name}{suffix}.json"
    argv = [*COMMON, *scenario.args, *(QUICK if quick else ()), "-i", scenario.protocol, "-u", f"127.0.0.1:{port}",
            "--label", server.name, "--json-file", str(out)]
    print(f"== {scenario.name} on {server.name}", file=sys.stderr, flush=True)
    perf.main(argv)
    document = json.loads(out.read_text())
    run_flag = f" --run {run}" if run > 1 else ""
    quick_flag = " --quick" if quick else ""
    document.update(scenario=scenario.name, server=server.name, server_version=server.version, run=run,
                    command=f"python -m load_tests.peers bench --only {scenario.name} --servers {server.name}"
                            f"{run_flag}{quick_flag}")
    out.write_text(json.dumps(document, indent=2) + "\n")
    return out


def bench(repo: Path, servers: list[str], only: list[str], out_dir: Path, run: int = 1, rounds: int | None = None,
          quick: bool = False) -> list[Path]:
    """Scenario by scenario, each server in turn (never two at a time), so drift in the machine's load hits
    every server alike rather than whichever ran last; a scenario with rounds repeats that turn-taking
    (`rounds` overrides its count). Servers that cannot run here are skipped with a note."""
    write_repository(repo)
    logs = repo / "logs"
    logs.mkdir(exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    missing = {name: available(name) for name in servers}
    for name, why in missing.items():
        if why:
            print(f"skipping {name}: {why}", file=sys.stderr)
    written = []
    for scenario in SCENARIOS:
        if only and scenario.name not in only:
            continue
        for turn in range(rounds or scenario.rounds):
            for name in servers:
                if name in scenario.servers and not missing[name]:
                    with FACTORIES[name](repo, logs).running() as server:
                        written.append(run_scenario(scenario, server, out_dir, run + turn, quick))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.peers", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_setup = sub.add_parser("setup", help="install the peers, each into its own venv")
    p_setup.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    p_setup.add_argument("--venv", type=Path, default=None, help="venv path (with a single --peers name)")
    p_repo = sub.add_parser("repo", help="write the benchmark models")
    p_repo.add_argument("directory", type=Path)
    p_start = sub.add_parser("start", help="serve the benchmark models with one server until Ctrl-C")
    p_start.add_argument("server", choices=list(FACTORIES))
    p_start.add_argument("directory", type=Path)
    p_start.add_argument("--seconds", type=float, default=3600.0, help="stop after this long (default 1 h)")
    p_bench = sub.add_parser("bench", help="run the scenarios and write bench/results/serving_*.json")
    p_bench.add_argument("--repo", type=Path, default=Path("/tmp/kiln-bench"))
    p_bench.add_argument("--servers", nargs="+", default=list(ALL), choices=list(FACTORIES))
    p_bench.add_argument("--only", nargs="*", default=[], choices=[s.name for s in SCENARIOS])
    p_bench.add_argument("--out", type=Path, default=RESULTS)
    p_bench.add_argument("--run", type=int, default=1, help="repeat number: > 1 writes serving_*_runN.json")
    p_bench.add_argument("--rounds", type=int, default=None,
                         help="rounds of turn-taking per scenario (default: the scenario's own, 3 for add_sub)")
    p_bench.add_argument("--quick", action="store_true",
                         help="0.5 s windows, 3 at most: checks that every server answers (not a result)")
    args = parser.parse_args(argv)
    if args.command == "setup":
        if args.venv is not None and len(args.peers) != 1:
            parser.error("--venv needs exactly one --peers name")
        for name in args.peers:
            setup_peer(name, args.venv)
    elif args.command == "repo":
        print(write_repository(args.directory))
    elif args.command == "start":
        write_repository(args.directory)
        with FACTORIES[args.server](args.directory, args.directory).running() as server:
            print(f"{server.name}: HTTP 127.0.0.1:{server.http_port}, gRPC 127.0.0.1:{server.grpc_port}", flush=True)
            try:
                time.sleep(args.seconds)
            except KeyboardInterrupt:
                pass
    else:
        for path in bench(args.repo, args.servers, args.only, args.out, args.run, args.rounds, args.quick):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
