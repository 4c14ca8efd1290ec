"""Python models (Triton's Python backend, `backend: "python"`): loading, one stub process per instance, and the
dynamic batcher handing a batch of requests to one `execute(requests)` call.

Loading a version (`load_python_version`): model.py must exist; the stubs run with the interpreter of the model's
`EXECUTION_ENV_PATH` (a directory with bin/python) or the server's. Instance 0's stub starts first and
`TritonPythonModel.auto_complete_config` completes the config (Triton calls it at load unless auto-completion is
switched off, which Kiln has no flag for); the completed config is checked (`complete_python_config`), the other
instances' stubs start, each gets `initialize(args)` with Triton's args, then the config's `model_warmup` samples
run on every instance. Any failure stops the stubs started and fails the load with the model's own message (an
exception's traceback included).

Requests run through `batcher.DynamicBatcher` (its queues, priorities, queue policies and statistics), which hands
each batch's jobs as they are to `PythonVersion._execute_jobs`: one EXECUTE call, one `execute(requests)` in the
stub, one response per request (a response may fail its own request). Without `dynamic_batching` every batch is one
request, as Triton runs them. A batch whose execute() raises fails its requests with the model's message; a stub that
dies fails the requests it was running, with how it ended, and is restarted (`Instance`); the others serve on.

A decoupled model (`model_transaction_policy { decoupled: true }`) answers through each request's response sender
instead: every request of an EXECUTE call gets a stream on the stub, whose responses go to the job's
`ResponseStream` as the model sends them, also after execute() returned (the batch's job is done then, and the
instance takes the next batch, as in Triton).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import engine_core as kiln
from server.protos import model_config_pb2
from server.python_backend import wire
from server.repository import ModelSource, select_versions

from . import placement, warmup
from .batcher import BatchingSettings, DynamicBatcher
from .config_fields import refusals
from .errors import ErrorKind, ServerError, invalid
from .loading import load_together
from .model import PAD_BATCH, PRECISION, PROFILE_BATCH_SIZES, ServedModel, _read_labels, execution_timeout_s
from .model_config import (
    DEFAULT_MODEL_FILENAME,
    PYTHON_BACKEND,
    ModelConfig,
    config_to_dict,
    parse_config_json,
)
from .python_stub import BlsRunner, StreamSink, Stub, StubCallError, StubFailure, StubLaunch, server_python
from .scheduler import Job, JobResult, Workers
from .sequence import SequenceBatcher, sequence_batcher
from .sequence_config import SEQUENCE_PARAMETERS, sequence_settings
from .statistics import ExecutionTimes
from .types import datatype_of_numpy

log = logging.getLogger("kiln.server.python")

DEFAULT_PYTHON_FILENAME = "model.py"
# Model config parameter (Triton's): a Python environment for the model's stubs, a directory with bin/python (a venv
# or an unpacked conda-pack); "$$TRITON_MODEL_DIRECTORY" in it is the model's directory.
EXECUTION_ENV_PATH = "EXECUTION_ENV_PATH"
MODEL_DIRECTORY_KEYWORD = "$$TRITON_MODEL_DIRECTORY"
#: request parameters Triton keeps for itself rather than handing them to the model (request.parameters())
RESERVED_PARAMETERS = frozenset({*SEQUENCE_PARAMETERS, "priority", "timeout",
                                 "binary_data_output"})
#: Kiln parameters about building a plan: a Python model has none
_PLAN_PARAMETERS = (PRECISION, PROFILE_BATCH_SIZES, PAD_BATCH, warmup.WARMUP_BUCKETS)
_KIND = model_config_pb2.ModelInstanceGroup
_INSTANCE_KINDS = {_KIND.KIND_CPU: "CPU", _KIND.KIND_GPU: "GPU"}
STOP_GRACE_S = 10.0  # how long finalize() may take at unload before the stub is killed
_STOPPING: set[asyncio.Future] = set()  # stops of unloaded versions under way, referenced until they end


def runs_python(config: ModelConfig, source: ModelSource) -> bool:
    """Whether the model is a Python model: backend "python", or (as Triton detects it) a config naming no backend,
    platform or model file whose newest version holds a model.py and no model.onnx."""
    if config.backend == PYTHON_BACKEND:
        return True
    if config.backend or config.platform or config.default_model_filename or not source.versions:
        return False
    newest = source.versions[max(source.versions)]
    return (newest / DEFAULT_PYTHON_FILENAME).is_file() and not (newest / DEFAULT_MODEL_FILENAME).is_file()


# -- configuration --------------------------------------------------------------------------------------------------
def complete_python_config(config: ModelConfig, name: str) -> ModelConfig:
    """A checked, completed copy of a Python model's config (after auto_complete_config): what Triton requires of
    one (every input and output has a data type), Kiln's refusals, and the defaults filled in."""
    config = ModelConfig.FromString(config.SerializeToString())
    if config.name and config.name != name:
        raise invalid(f"model '{name}': config names the model '{config.name}'; the directory name must match")
    config.name = name
    config.backend = PYTHON_BACKEND
    if config.platform:
        raise invalid(f"model '{name}': a Python model has no platform (backend 'python', platform "
                      f"'{config.platform}')")
    if config.max_batch_size < 0:
        raise invalid(f"model '{name}': max_batch_size must be >= 0, got {config.max_batch_size}")
    for role, tensors in (("input", config.input), ("output", config.output)):
        for tensor in tensors:
            if tensor.data_type == model_config_pb2.TYPE_INVALID:
                raise invalid(f"model '{name}': {role} '{tensor.name}' has no data_type: a Python model's config (or "
                              "its auto_complete_config) must give every input and output a data_type and dims")
            if tensor.data_type == model_config_pb2.TYPE_BF16:
                raise invalid(f"model '{name}': {role} '{tensor.name}' is TYPE_BF16, which Kiln does not yet pass to "
                              "Python models (numpy has no bfloat16)")
    if config.sequence_batching.state:
        raise invalid(f"model '{name}': Kiln does not yet keep implicit state for Python models (keep it in the "
                      "model, by request.correlation_id()). Remove sequence_batching's state")
    if config.HasField("sequence_batching") and config.model_transaction_policy.decoupled:
        raise invalid(f"model '{name}': sequence batching of decoupled models is not supported")
    for key in _PLAN_PARAMETERS:
        if key in config.parameters:
            raise invalid(f"model '{name}': parameter {key} is about the plan Kiln builds for an ONNX model; a Python "
                          "model has none. Remove it")
    found = refusals(config)  # auto_complete_config may have set what the table refuses (e.g. decoupled)
    if found:
        raise invalid(f"model '{name}': " + "; ".join(r.describe() for r in found))
    config.default_model_filename = config.default_model_filename or DEFAULT_PYTHON_FILENAME
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if not config.instance_group:
        config.instance_group.add(kind=_KIND.KIND_AUTO)
    for index, group in enumerate(config.instance_group):
        group.name = group.name or f"{name}_{index}"  # Triton's: <model>_<group index>; instances <group>_<index>
        group.count = group.count or 1
        if group.kind == _KIND.KIND_AUTO:  # Triton's choice: the GPU when there is one
            group.kind = _KIND.KIND_GPU if "cuda" in kiln.available_backends() else _KIND.KIND_CPU
        if group.kind == _KIND.KIND_GPU and "cuda" in kiln.available_backends():
            devices = placement.visible_devices().count
            if not group.gpus:  # Triton's: every visible GPU
                group.gpus.extend(range(devices))
            placement.check_ids(config, group, devices)
    return config


def stub_interpreter(config: ModelConfig, directory: Path) -> tuple[str, dict[str, str]]:
    """The Python that runs the model's stubs and the variables its environment needs: EXECUTION_ENV_PATH's
    bin/python (with the environment's bin first on PATH, as activating it would), else the server's own."""
    parameter = config.parameters.get(EXECUTION_ENV_PATH)
    text = parameter.string_value.strip() if parameter is not None else ""
    if not text:
        return server_python(), {}
    path = Path(text.replace(MODEL_DIRECTORY_KEYWORD, str(directory)))
    if text.endswith((".tar.gz", ".tgz")) or path.is_file():
        raise invalid(f"model '{config.name}': {EXECUTION_ENV_PATH} '{path}' is a packed environment; Kiln does not "
                      "unpack conda-pack archives yet. Unpack it (mkdir env && tar -xzf env.tar.gz -C env) and set "
                      f"{EXECUTION_ENV_PATH} to that directory")
    python = next((p for p in (path / "bin" / "python", path / "bin" / "python3") if p.is_file()), None)
    if python is None:
        raise invalid(f"model '{config.name}': {EXECUTION_ENV_PATH} '{path}' has no bin/python; it must be a Python "
                      "environment (a venv or an unpacked conda-pack) with numpy installed")
    bin_dir = str(python.parent)
    return str(python), {"VIRTUAL_ENV": str(path), "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}


# -- instances ------------------------------------------------------------------------------------------------------
class Instance:
    """One model instance: its stub (restarted after it dies), and how it is started (Triton's initialize args)."""

    def __init__(self, launch: StubLaunch, args: dict[str, str], model_file: Path, core: BlsRunner,
                 timeout_s: float | None) -> None:
        self.launch = launch
        self.args = args
        self.model_file = model_file
        self.timeout_s = timeout_s  # kiln_execution_timeout_ms: past it the stub is killed (and restarted)
        self.restarts = 0
        self.closed = False
        self._core = core
        self._stub: Stub | None = None
        self._starting: asyncio.Future | None = None

    @property
    def label(self) -> str:
        return self.launch.label

    async def start(self, stub: Stub | None = None) -> None:
        """Start (or adopt) the stub and initialize the model on it; ServerError with the model's message."""
        stub = stub or await _start_stub(self.launch, self._core)
        stub.launch = self.launch  # instance 0's stub was started before the config named its instance
        try:
            await stub.call(wire.INITIALIZE, {**self._model(), "args": self.args})
        except (StubCallError, StubFailure) as e:
            stub.kill()  # no finalize(): the model never finished initializing
            await stub.ended()
            raise invalid(f"model '{self.args['model_name']}' version {self.args['model_version']}: initialize of "
                          f"instance '{self.label}' failed: {_message(e)}") from None
        self._stub = stub
        stub.on_exit = self._stub_exited

    def _stub_exited(self, stub: Stub) -> None:
        """The stub ended (a crash, the OOM killer, a kill past its timeout): start it again now, not at the next
        request, so no request waits for it that need not."""
        if stub is self._stub and not self.closed and (self._starting is None or self._starting.done()):
            self._starting = asyncio.ensure_future(self._restart())
            self._starting.add_done_callback(self._restarted)

    def _model(self) -> dict[str, Any]:
        return {"model_file": str(self.model_file), "model_name": self.args["model_name"]}

    async def ready(self) -> Stub:
        """The running stub, restarting it first if it died (one restart at a time, shared by every caller)."""
        if self._starting is not None and not self._starting.done():
            await asyncio.shield(self._starting)  # a restart under way (raises what failed it)
        if self._stub is not None and self._stub.alive:
            return self._stub
        if self.closed:
            raise StubFailure(f"Stub process '{self.label}' is stopped: the model was unloaded")
        if self._starting is None or self._starting.done():
            self._starting = asyncio.ensure_future(self._restart())
        await asyncio.shield(self._starting)
        assert self._stub is not None
        return self._stub

    async def _restart(self) -> None:
        if self._stub is not None:  # killed past its timeout, it may not have ended yet
            self._stub.kill()
            await self._stub.ended()
        reason = self._stub.exit_reason if self._stub is not None else "is gone"
        log.warning("model instance '%s': its stub %s; restarting it", self.label, reason)
        await self.start()
        self.restarts += 1
        log.info("model instance '%s': stub restarted (pid %s; restart %d)", self.label,
                 self._stub.pid if self._stub else "?", self.restarts)

    async def execute(self, requests: list[dict], sinks: list[StreamSink] | None = None) -> list[dict]:
        """One EXECUTE call; StubFailure when the stub dies or is killed meanwhile (`_stub_exited` restarts it).
        With `sinks` (a decoupled model) each request gets a stream whose responses go to its sink; when the call
        fails, its streams end here quietly (the batch's error answers them)."""
        stub = await self.ready()
        streams = [stub.open_stream(sink) for sink in sinks or ()]
        for body, stream in zip(requests, streams):
            body["stream"] = stream
        try:
            return await stub.call(wire.EXECUTE, requests, self.timeout_s)
        except BaseException:
            for stream in streams:
                stub.close_stream(stream, notify=False)
            raise

    def cancel(self, stream: int) -> None:
        """A decoupled request's client gave up: the model's sender tells it."""
        if self._stub is not None:
            self._stub.cancel_stream(stream)

    def _restarted(self, done: asyncio.Future) -> None:
        """A background restart's failure is logged here (the next request retries it and hears the reason)."""
        if not done.cancelled() and done.exception() is not None:
            log.error("model instance '%s': could not restart its stub: %s", self.label,
                      getattr(done.exception(), "message", done.exception()))

    async def stop(self) -> None:
        self.closed = True
        if self._starting is not None and not self._starting.done():
            await asyncio.gather(self._starting, return_exceptions=True)
        if self._stub is not None:
            await self._stub.stop(STOP_GRACE_S)


async def _start_stub(launch: StubLaunch, core: BlsRunner) -> Stub:
    try:
        return await Stub.start(launch, core)
    except StubFailure as e:
        raise invalid(f"model '{launch.model_name}': {e}") from None


def _message(error: BaseException) -> str:
    return error.message if isinstance(error, StubCallError) else str(error)


# -- the served version ---------------------------------------------------------------------------------------------
class PythonVersion(ServedModel):
    """A loaded Python model version: its instances (stubs) and the batcher that runs requests on them."""

    #: outputs go out in the data type the model made them, whatever the config says (Triton's Python backend)
    casts_outputs = False

    def __init__(self, name: str, version: int, config: ModelConfig, labels: dict[str, list[str]],
                 instances: list[Instance], directory: Path | None = None) -> None:
        super().__init__(name, version, config, labels)
        self.instances = instances
        self.decoupled = config.model_transaction_policy.decoupled
        self._all_outputs = list(self.outputs)  # what a request that names no output gets
        self._dtypes_ok: dict[str, set[np.dtype]] = {}  # per output, the dtypes seen (a mismatch is logged once)
        self._loop = asyncio.get_running_loop()
        # the batchers' contexts are this version's Instances (typed `object` there): the arguments say so
        sequence = sequence_settings(config, None, directory) if directory is not None else None
        batcher: DynamicBatcher | SequenceBatcher
        if sequence is not None:  # requests as they are, each with its control inputs (sequence.sequence_batcher)
            batcher = sequence_batcher(instances, _not_used, f"kiln-{name}-{version}",  # type: ignore[arg-type]
                                       sequence, self._record_execution,
                                       execute_jobs=self._execute_jobs)  # type: ignore[arg-type]
        else:
            if config.HasField("dynamic_batching") and config.max_batch_size > 0:
                settings = BatchingSettings.from_config(config.dynamic_batching, config.max_batch_size, name)
            else:  # one request per execute(), as Triton runs a model without a batcher
                settings = BatchingSettings.from_config(model_config_pb2.ModelDynamicBatching(), 1, name)
            batcher = DynamicBatcher(instances, _not_used, f"kiln-{name}-{version}",  # type: ignore[arg-type]
                                     settings, self._record_execution,
                                     execute_jobs_async=self._execute_jobs_async)  # type: ignore[arg-type]
        batcher.workers.label = f"model '{name}'"
        self.scheduler = PythonScheduler(batcher, self._stop_instances)

    def _record_execution(self, batch_size: int, times: ExecutionTimes) -> None:
        self.statistics.record_execution(batch_size, times)

    @property
    def workers(self) -> Workers:
        return self.scheduler.workers  # type: ignore[attr-defined]  # a DynamicBatcher (above)

    def request_body(self, job: Job) -> dict[str, Any]:
        """A job as the stub builds its pb_utils.InferenceRequest: Triton's reserved parameters become the request's
        correlation id and flags, the others its parameters() JSON."""
        parameters = job.parameters
        flags = (1 if parameters.get("sequence_start") else 0) | (2 if parameters.get("sequence_end") else 0)
        extra = {k: v for k, v in parameters.items() if k not in RESERVED_PARAMETERS} if parameters else None
        return {"request_id": job.request_id, "correlation_id": parameters.get("sequence_id", 0) or 0,
                "inputs": list(job.inputs.items()), "outputs": list(job.outputs) if job.outputs else self._all_outputs,
                "model_version": self.version, "flags": flags,
                "parameters": json.dumps(extra) if extra else "{}"}

    def _execute_jobs(self, instance: Instance, jobs: list[Job]) -> list[dict[str, np.ndarray] | BaseException]:
        """In a batcher worker thread (the sequence batcher's): `_execute_jobs_async` on the event loop."""
        return asyncio.run_coroutine_threadsafe(self._execute_jobs_async(instance, jobs), self._loop).result()

    async def _execute_jobs_async(self, instance: Instance,
                                  jobs: list[Job]) -> list[dict[str, np.ndarray] | BaseException]:
        """On the event loop: one execute() for the batch on `instance`, its results per job. Nothing is raised: a
        failure answers the batch's requests (the stub restarts itself), so the instance serves on."""
        bodies = [self.request_body(job) for job in jobs]
        prefix = f"Failed to process the request(s) for model '{instance.label}', message: "  # Triton 2.51's words
        sinks = [self._sink(instance, body, job) for body, job in zip(bodies, jobs)] if self.decoupled else None
        try:
            results = await instance.execute(bodies, sinks)
        except StubCallError as e:  # execute() raised: every request of the batch fails with its message
            return [e.as_server_error(prefix) for _ in jobs]
        except StubFailure as e:
            log.error("%s%s", prefix, e)
            return [ServerError(ErrorKind.INTERNAL, f"{prefix}{e}; the instance is restarted, retrying may succeed")
                    for _ in jobs]
        except ServerError as e:  # its stub died before and could not be started again
            return [ServerError(ErrorKind.UNAVAILABLE, f"{prefix}the instance could not be restarted: {e.message}")
                    for _ in jobs]
        except Exception as e:  # noqa: BLE001 - e.g. the event loop closing under a stopping server
            return [ServerError(ErrorKind.INTERNAL, f"{prefix}{type(e).__name__}: {e}") for _ in jobs]
        if self.decoupled:  # execute() returned: the responses come (or came) through the jobs' streams
            return [{} for _ in jobs]
        return [self._outputs(job, result) for job, result in zip(jobs, results)]

    def _sink(self, instance: Instance, body: dict, job: Job) -> StreamSink:
        """Where the stub's responses to a decoupled request go: checked like any response, to the job's stream."""
        stream = job.responses
        assert stream is not None, "a decoupled model's job comes with its ResponseStream"
        stream.on_cancel = lambda: instance.cancel(body["stream"])

        def deliver(result: dict | None, final: bool) -> None:
            outcome = None if result is None else self._outputs(job, result, partial=True)
            if isinstance(outcome, BaseException):
                stream.deliver(None, outcome, final)
            else:
                stream.deliver(outcome, None, final)

        return deliver

    def _outputs(self, job: Job, result: dict, partial: bool = False) -> dict[str, np.ndarray] | BaseException:
        """One response: its error, or the outputs the request asked for, each of the config's data type. A
        decoupled model's response (`partial`) may carry some of them only."""
        if "error" in result:
            return StubCallError(*result["error"]).as_server_error()
        returned = dict(result["outputs"])
        outputs = {}
        for name in job.outputs or self.outputs:
            if partial and name not in returned:
                continue
            if name not in returned:
                return ServerError(ErrorKind.INTERNAL, f"model '{self.name}': execute() returned no output '{name}' "
                                                       f"for a request that asked for it (returned: {sorted(returned)})")
            array = returned[name]
            dtype = array.dtype
            if dtype in self._dtypes_ok.get(name, ()):  # a dtype this output has had before: nothing to look up
                outputs[name] = array
                continue
            datatype, expected = datatype_of_numpy(dtype), self.outputs[name].datatype
            if datatype != expected:  # Triton sends it as the model made it (its own bls_decoupled example does)
                log.warning("model '%s': output '%s' is %s, the config says %s; sent as %s, as Triton does",
                            self.name, name, datatype, expected, datatype)
            self._dtypes_ok.setdefault(name, set()).add(dtype)  # said once per dtype
            outputs[name] = array
        return outputs

    async def warm_up(self, directory: Path) -> None:
        """The config's model_warmup samples, `count` times (once when 0) on every instance, as requests; a sample
        that does not fit the model, or whose response is an error, fails the load naming it. Not counted in the
        statistics (as in Triton)."""
        for sample in self.config.model_warmup:
            label = f"model '{self.name}': warmup sample '{sample.name}'"
            try:
                arrays, datatypes = warmup.sample_inputs(sample, self.config, directory, label)
                inputs, batch = self.check_inputs(arrays, datatypes)
                body = self.request_body(Job(inputs, batch))
                for instance in self.instances:
                    for _ in range(max(sample.count, 1)):
                        if self.decoupled:
                            await self._warm_up_stream(instance, dict(body), Job(inputs, batch))
                            continue
                        result = (await instance.execute([body]))[0]
                        outcome = self._outputs(Job(inputs, batch), result)
                        if isinstance(outcome, BaseException):
                            raise outcome
            except ServerError as e:
                raise invalid(e.message if e.message.startswith(label) else f"{label} failed: {e.message}") from None
            except (StubCallError, StubFailure) as e:
                raise invalid(f"{label} failed: {_message(e)}") from None
            except TimeoutError:
                raise invalid(f"{label} failed: no final response within {WARMUP_STREAM_TIMEOUT_S:g} s") from None
            log.info("%s ran %d time(s) on %d instance(s)", label, max(sample.count, 1), len(self.instances))

    async def _warm_up_stream(self, instance: Instance, body: dict, job: Job) -> None:
        """One warm-up request of a decoupled model: execute(), then its responses until the final flag (Triton
        warms decoupled models too); the first error response fails the sample."""
        ended: asyncio.Future = asyncio.get_running_loop().create_future()
        failure: list[BaseException] = []

        def sink(result: dict | None, final: bool) -> None:
            outcome = None if result is None else self._outputs(job, result, partial=True)
            if isinstance(outcome, BaseException) and not failure:
                failure.append(outcome)
            if final and not ended.done():
                ended.set_result(None)

        await instance.execute([body], [sink])
        await asyncio.wait_for(ended, WARMUP_STREAM_TIMEOUT_S)
        if failure:
            raise failure[0]

    async def _stop_instances(self) -> None:
        await asyncio.gather(*(instance.stop() for instance in self.instances), return_exceptions=True)
        log.info("model '%s' version %d: Python stubs stopped", self.name, self.version)

    def close(self) -> None:
        """Take no new requests; once those admitted are answered, finalize() runs and the stubs end."""
        self.scheduler.close()


#: how long a decoupled model's warm-up request may take to send its final response
WARMUP_STREAM_TIMEOUT_S = 60.0


def _not_used(context: object, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    raise AssertionError("Python models run through execute_jobs")


class PythonScheduler:
    """The `Scheduler` of a Python model: its dynamic batcher, and the stubs stopped once it is closed and the
    last admitted request is answered (a hot swap or an unload fails nothing that was accepted)."""

    def __init__(self, batcher: DynamicBatcher | SequenceBatcher, stop: Callable[[], Any]) -> None:
        self.batcher = batcher
        self._stop = stop
        self._active = 0
        self._closed = False
        self._stopped = False

    @property
    def workers(self) -> Workers:
        return self.batcher.workers

    def enqueue(self, job: Job) -> asyncio.Future:
        future = self.batcher.enqueue(job)
        self._active += 1
        future.add_done_callback(self._finished)
        return future

    async def submit(self, job: Job) -> JobResult:
        return await self.enqueue(job)

    def pending(self) -> dict[int, int]:
        return self.batcher.pending()

    def close(self) -> None:
        self.batcher.close()
        self._closed = True
        self._stop_if_idle()

    def _finished(self, _: asyncio.Future) -> None:
        self._active -= 1
        self._stop_if_idle()

    def _stop_if_idle(self) -> None:
        if self._closed and not self._active and not self._stopped:
            self._stopped = True
            task = asyncio.ensure_future(self._stop())
            _STOPPING.add(task)
            task.add_done_callback(_STOPPING.discard)


async def python_stubs_stopped() -> None:
    """Wait for the stubs of closed versions to stop (finalize() included; each is killed past STOP_GRACE_S)."""
    if _STOPPING:
        await asyncio.wait(set(_STOPPING), timeout=2 * STOP_GRACE_S)


# -- loading --------------------------------------------------------------------------------------------------------
async def load_python_versions(source: ModelSource, config: ModelConfig, core: BlsRunner) -> dict[int, ServedModel]:
    """Every version the policy selects, loaded together; if one fails, those loaded are stopped again."""
    wanted = select_versions(config.version_policy, list(source.versions))
    return dict(await load_together(load_python_version(source, v, config, core) for v in wanted))


async def load_python_version(source: ModelSource, version: int, config: ModelConfig,
                              core: BlsRunner) -> PythonVersion:
    """Start, complete, initialize and warm up one version (see the module docstring)."""
    name = source.name
    filename = config.default_model_filename or DEFAULT_PYTHON_FILENAME
    model_file = source.model_file(version, filename)
    if not model_file.is_file():
        raise invalid(f"model '{name}' version {version}: '{filename}' is missing in {model_file.parent}")
    python, environment = stub_interpreter(config, source.directory)
    requested = ModelConfig.FromString(config.SerializeToString())
    requested.name, requested.backend = name, PYTHON_BACKEND  # as Triton hands it to auto_complete_config
    first = await _start_stub(StubLaunch(python, f"{name}_0_0", name, environment), core)  # instance 0 of group 0
    instances: list[Instance] = []
    try:
        config = await _auto_complete(first, requested, model_file, version)
        instances = _instances(config, source, version, model_file, python, environment, core)
        await instances[0].start(first)
        await asyncio.gather(*(instance.start() for instance in instances[1:]))
        model = PythonVersion(name, version, config, _read_labels(source, config), instances, source.directory)
        await model.warm_up(source.directory)
    except BaseException:
        await asyncio.gather(*(instance.stop() for instance in instances), return_exceptions=True)
        first.kill()  # when no instance adopted it
        raise
    log.info("model '%s' version %d: %d Python instance(s) ready (%s)", name, version, len(instances), python)
    return model


async def _auto_complete(stub: Stub, config: ModelConfig, model_file: Path, version: int) -> ModelConfig:
    """`TritonPythonModel.auto_complete_config` on the config (as Triton passes it: JSON with every field), then
    the result checked and completed."""
    name = config.name
    try:
        text = await stub.call(wire.AUTO_COMPLETE, {"model_file": str(model_file), "model_name": name,
                                                    "config": json.dumps(config_to_dict(config))})
    except (StubCallError, StubFailure) as e:
        raise invalid(f"model '{name}' version {version}: {_message(e)}") from None
    return complete_python_config(parse_config_json(text, name), name)


def _instances(config: ModelConfig, source: ModelSource, version: int, model_file: Path, python: str,
               environment: dict[str, str], core: BlsRunner) -> list[Instance]:
    """One Instance per instance_group count (on each of a KIND_GPU group's GPUs), with Triton's initialize args (the
    completed config as JSON; `model_instance_device_id` the GPU). Stubs see every GPU: the model places its own
    work there, as under Triton's Python backend."""
    timeout_s = execution_timeout_s(config)
    config_json = json.dumps(config_to_dict(config))
    instances = []
    for group in config.instance_group:
        # Triton's: `count` instances on each listed GPU of a KIND_GPU group, named alike on every GPU
        devices = list(group.gpus) if group.kind == _KIND.KIND_GPU and group.gpus else [0]
        for index, device in ((index, device) for index in range(group.count) for device in devices):
            label = f"{group.name}_{index}"
            args = {"model_config": config_json, "model_instance_kind": _INSTANCE_KINDS.get(group.kind, "CPU"),
                    "model_instance_name": label, "model_instance_device_id": str(device),
                    "model_repository": str(source.directory), "model_version": str(version),
                    "model_name": config.name}
            instances.append(Instance(StubLaunch(python, label, config.name, environment), args, model_file, core,
                                      timeout_s))
    return instances

