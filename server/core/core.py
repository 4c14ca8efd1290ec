"""`ServerCore`: everything the server does, behind async methods that both frontends call.

The frontends translate HTTP/JSON or protobuf into these calls and the results (plain dicts with Triton's
field names, or `InferResponse`) back; errors are `ServerError`s whose kind each frontend maps to a status.
Model state lives here and is only changed on the event loop; builds and inference run in threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import engine_core as kiln
from server.repository import ModelRepository, ModelSource, RepositoryPoller, check_upload, select_versions

from . import cuda_ipc, decoupled, direct_replies, generative, part_groups, repository_agents, request_io, warmup
from .adaptive import close_enough, describe, fit_profiles
from .batcher import DynamicBatcher
from .config_fields import ConfigFieldCheck
from .custom_metrics import CustomMetrics
from .direct_replies import DELIVERED
from .ensemble import EnsembleVersion, complete_ensemble_config, dependency_path
from .errors import ErrorKind, ServerError, invalid, not_found, unavailable, unimplemented, unknown_model
from .grouping import Answer, Part, run_members, settle
from .heap import freeze_long_lived
from .loading import load_together
from .model import ModelVersion, ServedModel, load_model_version, with_default_execution_timeout
from .model_config import ModelConfig, config_to_dict, is_ensemble, parse_config_json, parse_config_text
from .python_model import load_python_versions, python_stubs_stopped, runs_python
from .response_cache import CacheConfig, Lookup, make_cache, store_outputs
from .scheduler import Job
from .sequence_config import SEQUENCE_PARAMETERS
from .settings import AdaptiveSettings, LogSettings, TraceSettings
from .shared_memory import SharedMemory
from .statistics import ExecutionTimes
from .types import InferRequest, InferResponse, RequestedOutput, datatype_of_numpy

log = logging.getLogger("kiln.server")

# Triton's text (server/src/common.h kClientShmDisabledErrorStr) with Kiln's flag spelled the same way.
CLIENT_SHM_DISABLED = ("Client shared memory is disabled. Start the server with '--allow-client-shm=true' to "
                       "enable.")

SERVER_NAME = "kiln"
EXTENSIONS = [
    "classification", "model_configuration", "model_repository", "model_repository(unload_dependents)",
    "schedule_policy", "statistics", "system_shared_memory", "binary_tensor_data", "parameters", "trace",
    "logging",
]


@dataclass
class CoreOptions:
    """Server-wide settings (`kiln serve` flags map onto these)."""

    model_repositories: list[str]
    model_control_mode: str = "none"  # "none": load everything at start; "explicit": load/unload API; "poll"
    repository_poll_secs: float = 15.0  # poll mode: seconds between repository scans
    startup_models: list[str] = field(default_factory=list)  # explicit mode: models to load at start ("*" = all)
    default_max_batch_size: int = 4
    execution_timeout_ms: float | None = None  # --execution-timeout-ms: for configs without kiln_execution_timeout_ms
    strict_readiness: bool = True
    load_concurrency: int = 4  # --model-load-thread-count: models building at once (ensembles take no turn)
    server_id: str | None = None  # --id: the name in the server's metadata (None: "kiln")
    log_verbose: int = 0
    log_file: str = ""
    log_format: str = "default"
    adaptive: AdaptiveSettings = field(default_factory=AdaptiveSettings.from_env)  # --adaptive-profiles
    allow_client_shm: bool = False  # --allow-client-shm: Triton's default is off too
    lenient_config: bool = False  # --lenient-config: refused config fields are logged and ignored, not fatal
    response_cache: CacheConfig | None = None  # --cache-config local,size=<bytes>: Triton's response cache


class ModelState:
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass
class ModelEntry:
    """A model the server knows about: its state, why (if not ready), and its loaded versions."""

    name: str
    state: str = ModelState.UNAVAILABLE
    reason: str = "unloaded"
    versions: dict[int, ServedModel] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: loaded because it was asked for (start-up, poll, load API), not only as an ensemble's composing model:
    #: unloading that ensemble with unload_dependents leaves it loaded (Triton's explicitly_load_)
    explicit: bool = False

    def latest(self) -> ServedModel | None:
        return self.versions[max(self.versions)] if self.versions else None


class ServerCore:
    """The protocol-neutral server. Create, `await start()`, serve, `await stop()`."""

    def __init__(self, options: CoreOptions) -> None:
        if options.model_control_mode not in ("none", "explicit", "poll"):
            raise ValueError(f"model control mode must be 'none', 'explicit' or 'poll', got '{options.model_control_mode}'")
        self.options = options
        self.repository = ModelRepository(options.model_repositories)
        self.models: dict[str, ModelEntry] = {}
        self.system_shm = SharedMemory()  # system and CUDA regions, one namespace as in Triton
        self.logging = LogSettings(options.log_verbose, options.log_file, options.log_format)
        self.trace = TraceSettings()
        self.config_fields = ConfigFieldCheck(options.lenient_config)
        self.response_cache = make_cache(options.response_cache)
        self.custom_metrics = CustomMetrics()  # Python models' pb_utils.MetricFamily, exported on /metrics
        self._startup: list[asyncio.Task] = []
        self.startup_failures: list[str] = []  # "name: reason" of the models that failed to load at start
        self._load_slots: asyncio.Semaphore | None = None  # made on the loop, at the first load
        self._startup_names: list[str] = []
        self._started = False
        self._stopping = False
        self._poller: RepositoryPoller | None = None
        if options.model_control_mode == "poll":  # raises ValueError for a bad interval, before serving
            self._poller = RepositoryPoller(self.repository, options.repository_poll_secs,
                                            self._load_quietly, self._unload)
        self._startup_poll: asyncio.Task | None = None
        #: ensembles being loaded -> the models their steps name (with the loaded ensembles': cycle checks)
        self._ensembles_loading: dict[str, set[str]] = {}
        self._adaptive_task: asyncio.Task | None = None
        self._draining = False

    # -- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Begin loading the startup models in the background; `ready()` turns true when they are done."""
        names = self.repository.names()
        if self.options.model_control_mode == "explicit":
            wanted = self.options.startup_models
            names = names if "*" in wanted else list(dict.fromkeys(wanted))
        self._startup_names = names
        if self._poller is not None:
            self._poller.baseline()
        self._startup = [asyncio.create_task(self._load_quietly(name)) for name in names]
        if self._poller is not None:
            self._startup_poll = asyncio.create_task(self._poll_after_startup())
        if self.options.adaptive.enabled:
            self._adaptive_task = asyncio.create_task(self._adapt_profiles_forever())
        self._started = True

    async def _poll_after_startup(self) -> None:
        await asyncio.gather(*self._startup, return_exceptions=True)
        await self._poller.run()  # type: ignore[union-attr]

    async def wait_for_startup(self) -> None:
        if self._startup:
            await asyncio.gather(*self._startup)

    async def _load_quietly(self, name: str) -> None:
        """A startup load: the failure is already logged and shown in the repository index, and kept for
        `--exit-on-error`."""
        try:
            await self._load(name, None, None)
        except ServerError as e:
            self.startup_failures.append(f"{name}: {e.message}")

    def begin_drain(self) -> None:
        """Shutting down: report not ready (so traffic moves elsewhere) while accepted requests finish."""
        self._draining = True

    async def stop(self) -> None:
        self._stopping = True
        for task in [*self._startup, *(t for t in (self._startup_poll, self._adaptive_task) if t)]:
            task.cancel()
        for entry in self.models.values():
            for version in entry.versions.values():
                version.close()
        await python_stubs_stopped()  # Python models' finalize() runs before the server exits, as in Triton
        self.system_shm.close()
        self.repository.close()

    # -- health and metadata --------------------------------------------------------------------------------
    async def live(self) -> bool:
        return not self._stopping

    async def ready(self) -> bool:
        """Live, startup loading finished, and (strict readiness) every startup model READY."""
        if self._stopping or self._draining or not self._started or any(not t.done() for t in self._startup):
            return False
        if not self.options.strict_readiness:
            return True
        return all(self.models.get(n) is not None and self.models[n].state == ModelState.READY
                   for n in self._startup_names)

    async def server_metadata(self) -> dict[str, Any]:
        cuda = ["cuda_shared_memory"] if cuda_ipc.available() else []  # only where a region can be registered
        return {"name": self.options.server_id or SERVER_NAME, "version": kiln.__version__,
                "extensions": [*EXTENSIONS, *cuda]}

    def _version(self, name: str, version: str = "") -> ServedModel:
        """The ready version `version` of model `name` ("" = the latest ready one)."""
        entry = self.models.get(name)
        if entry is None or (not entry.versions and entry.state != ModelState.LOADING):
            if entry is None and name not in self.repository.names():
                raise not_found(unknown_model(name))
            raise unavailable(f"Request for unknown model: '{name}' has no available versions "
                              f"(not loaded: {entry.reason if entry else 'unloaded'})")
        if not entry.versions:
            raise unavailable(f"Request for unknown model: '{name}' has no available versions "
                              f"(it is {entry.state.lower()})")
        if not version:
            return entry.latest()  # type: ignore[return-value]
        if not version.isdigit() or int(version) not in entry.versions:
            raise not_found(f"Request for unknown model: '{name}' version {version} is not found "
                            f"(no ready version '{version}'; ready: {sorted(entry.versions)})")
        return entry.versions[int(version)]

    async def model_ready(self, name: str, version: str = "") -> bool:
        """True when the version is loaded and serving, else False, unknown models included: Triton answers
        readiness, never NOT_FOUND (gRPC ready=false; HTTP 400 "Model version not ready")."""
        try:
            self._version(name, version)
            return True
        except ServerError:
            return False

    async def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        """KServe model metadata: name, versions (all ready ones), platform, inputs and outputs."""
        model = self._version(name, version)
        metadata = model.metadata()
        if not version:
            metadata["versions"] = [str(v) for v in sorted(self.models[name].versions)]
        return metadata

    async def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        """The completed Triton model configuration as a JSON-able dict (proto field names)."""
        return config_to_dict(self._version(name, version).config)

    # -- inference ------------------------------------------------------------------------------------------
    async def infer(self, request: InferRequest) -> InferResponse:
        """Run one request: resolve shared memory, check against the config, execute, post-process outputs."""
        answer = asyncio.get_running_loop().create_future()
        job = self.submit_infer(request, functools.partial(settle, answer))
        try:
            return await answer
        except asyncio.CancelledError:
            if job is not None:
                job.cancel()  # a queued request leaves the batcher's queue
            raise

    def submit_infer(self, request: InferRequest, reply: Answer, requests: int = 1,
                     inbox: tuple[int, int] | None = None) -> asyncio.Future | None:
        """Start one request without a task of its own: `reply(response, None)` or `reply(None, error)` is called
        exactly once, on the event loop (with a CancelledError when the job is cancelled). Returns the queued
        job's future (cancel it to withdraw the request), or None when the request was answered at once.

        Why callbacks: the core process serves every frontend on one event-loop thread, and a task per request
        (creation, scheduling, two steps) was a large share of its time per request (docs/performance.md).
        `requests`: how many client requests this one stands for (a frontend's group), for the statistics.
        `inbox`: (the frontend process's inbox, its call id) when an executor may answer that frontend itself
        (direct_replies.py); `reply` then gets `DELIVERED` once it has."""
        started = time.perf_counter_ns()
        try:  # a decoupled model's requests take submit_stream: one response per call is refused (decoupled.py)
            model = decoupled.single_response(self._version(request.model_name, request.model_version))
        except ServerError as e:
            reply(None, e)
            return None
        if isinstance(model, EnsembleVersion):
            return self._submit_ensemble(model, request, reply, requests, started)
        trace = self.trace.start(model.name, str(model.version), request.id, request.traceparent)
        if trace:
            trace.mark("REQUEST_START")
        try:
            inputs, batch, requested = self._checked(model, request)
            if trace:
                trace.record_tensors("TENSOR_QUEUE_INPUT", [(t.name, t.datatype, inputs[t.name])
                                                            for t in request.inputs if t.name in inputs])
            cached = self._look_up(model, request, inputs, requested, requests)
            if cached is not None and cached.outputs is not None:
                self._answer_cached(model, request, requested, cached, trace, started, reply)
                return None
            # not an ensemble: a ModelVersion, or a PythonVersion, which _prepare/_finish serve alike
            job, destinations = self._prepare(model, request, inputs, batch, requested)  # type: ignore[arg-type]
            job.requests = requests
            if inbox is not None and not trace and cached is None and not destinations:
                job.route = direct_replies.route_for(model, requested, request.id, *inbox, request_io.writes_in_place)
            if trace:
                trace.mark("QUEUE_START")
            future = model.scheduler.enqueue(job)
        except Exception as e:  # noqa: BLE001 - answered, as `infer` would have raised it
            model.statistics.record_failure(time.perf_counter_ns() - started, requests)
            reply(None, e)
            return None
        future.add_done_callback(lambda done: self._finish(done, model, request, job.batch_size,  # type: ignore[arg-type]
                                                           requested, destinations, trace, started, reply, requests, cached))
        return future

    def submit_stream(self, request: InferRequest, on_part: decoupled.OnPart) -> Any:
        """A request answered by zero or more responses, then a final flag (decoupled.py): gRPC and HTTP streams."""
        return decoupled.submit_stream(self, request, on_part)

    def submit_infer_group(self, request: InferRequest, sizes: list[int], reply: Answer,
                           inbox: tuple[int, int] | None = None) -> list[asyncio.Future]:
        """Start a frontend's group of alike requests (grouping.py): `request` holds their inputs concatenated, `sizes[i]`
        rows for member i. A dynamically batched model whose batch holds them runs the group as one job, `reply` gets
        every member's rows (the frontend cuts them) or the error for all; else (a model that caches responses too)
        each member runs alone and `reply` gets their `MemberResults`. Returns the futures that withdraw the group.
        `inbox`: as `submit_infer`'s, for the group run as one job."""
        if not 0 < sum(sizes) <= self.group_rows(request):  # an unknown model too: each member hears it
            return run_members(request, sizes, self.submit_infer, lambda results: reply(results, None))
        job = self.submit_infer(request, reply, requests=len(sizes), inbox=inbox)
        return [job] if job is not None else []

    def submit_infer_parts(self, first: InferRequest, parts: list[Part], reply: Answer) -> list[asyncio.Future]:
        """A frontend's group of alike requests in shared memory, as one job of parts (part_groups.py)."""
        return part_groups.submit_parts(self, first, parts, reply)

    def group_rows(self, request: InferRequest) -> int:
        """The most rows a group of requests alike `request` runs as one job (its model's max_batch_size); 0 when
        such a group runs member by member (no dynamic batcher, tracing on, a response cache, an unknown model)."""
        with contextlib.suppress(ServerError):
            model = self._version(request.model_name, request.model_version)
            if (isinstance(model, ModelVersion) and isinstance(model.scheduler, DynamicBatcher)
                    and not self.trace.active and not self.caches_responses(model)):
                return model.max_batch_size
        return 0

    def _prepare(self, model: ModelVersion, request: InferRequest, inputs: dict[str, Any], batch: int,
                 requested: list[RequestedOutput]) -> tuple[Job, dict[str, kiln.DeviceView]]:
        """The checked request turned into a job, and the outputs the engine writes straight into CUDA shared
        memory."""
        if isinstance(model, ModelVersion):  # a Python model (python_model.py) has no plan to fit to traffic
            model.traffic.record(inputs)  # a group once: its members' shapes are alike
        destinations = request_io.output_views(self.system_shm, model, requested, inputs)
        return Job(inputs, batch, parameters=request.parameters, destinations=destinations, request_id=request.id,
                   outputs=tuple(o.name for o in requested)), destinations

    def _checked(self, model: ServedModel, request: InferRequest
                 ) -> tuple[dict[str, Any], int, list[RequestedOutput]]:
        """The request's inputs (read from shared memory where they are) checked against the model's config, its
        batch size, and the outputs it asks for (all when it names none)."""
        arrays = {}
        datatypes = {}
        if request.raw_input is not None:
            request.inputs = [request_io.raw_input(model, request.raw_input)]
        for tensor in request.inputs:
            if tensor.name in arrays:  # Triton (core/src/infer_request.cc AddOriginalInput) says exactly this
                raise invalid(f"input '{tensor.name}' already exists in request (given more than once)")
            arrays[tensor.name] = request_io.input_array(self.system_shm, tensor, model)
            datatypes[tensor.name] = tensor.datatype
        request_io.check_unique_outputs(request.outputs)
        requested = request.outputs or [RequestedOutput(name) for name in model.outputs]
        model.check_outputs([o.name for o in requested])
        inputs, batch = model.check_inputs(arrays, datatypes)
        return inputs, batch, requested

    def _submit_ensemble(self, model: EnsembleVersion, request: InferRequest, reply: Answer, requests: int,
                         started: int) -> asyncio.Future | None:
        """`submit_infer` for an ensemble: checked like any request, then its steps run as a task (cancel it to
        withdraw the request and its steps); each step is a request to its composing model through `infer`."""
        trace = self.trace.start(model.name, str(model.version), request.id, request.traceparent)
        if trace:
            trace.mark("REQUEST_START")
        try:
            inputs, batch, requested = self._checked(model, request)
            cached = self._look_up(model, request, inputs, requested, requests)
        except Exception as e:  # noqa: BLE001 - answered, as `infer` would have raised it
            model.statistics.record_failure(time.perf_counter_ns() - started, requests)
            reply(None, e)
            return None
        if cached is not None and cached.outputs is not None:
            self._answer_cached(model, request, requested, cached, trace, started, reply)
            return None
        times = ExecutionTimes(compute_input_ns=time.perf_counter_ns() - started)
        if trace:
            trace.mark("QUEUE_START")
        task = asyncio.ensure_future(model.run(inputs, batch, request, [o.name for o in requested], self.infer))
        task.add_done_callback(lambda done: self._finish_ensemble(done, model, request, batch, requested, times,
                                                                  trace, started, reply, requests, cached))
        return task

    def _finish_ensemble(self, done: asyncio.Future, model: EnsembleVersion, request: InferRequest, batch: int,
                         requested: list[RequestedOutput], times: ExecutionTimes, trace, started: int,
                         reply: Answer, requests: int, cached: Lookup | None = None) -> None:
        """An ensemble's steps are done: its outputs post-processed (shared memory, classification) into the
        response. Its statistics count one execution per request, as Triton's do; compute_infer is the time its
        steps took together (Triton adds up its steps' compute times instead)."""
        if done.cancelled():
            reply(None, asyncio.CancelledError())
            return
        try:
            arrays = done.result()
            if trace:
                trace.mark("COMPUTE_END")
            t0 = time.perf_counter_ns()
            times.compute_infer_ns = t0 - started - times.compute_input_ns
            outputs = [request_io.output(self.system_shm, model, o, arrays[o.name]) for o in requested]
            times.compute_output_ns = time.perf_counter_ns() - t0
        except Exception as e:  # noqa: BLE001 - the caller hears it
            model.statistics.record_failure(time.perf_counter_ns() - started, requests)
            reply(None, e)
            return
        self._store(model, cached, arrays, requested)
        model.statistics.record_success(batch, time.perf_counter_ns() - started, times, requests)
        model.statistics.record_execution(batch, times)
        if trace:
            trace.mark("REQUEST_END")
            self.trace.finish(trace)
        reply(InferResponse(model.name, str(model.version), outputs, id=request.id), None)

    def _finish(self, done: asyncio.Future, model: ModelVersion, request: InferRequest, batch: int,
                requested: list[RequestedOutput], destinations: dict[str, kiln.DeviceView], trace,
                started: int, reply: Answer, requests: int, cached: Lookup | None = None) -> None:
        """A job's future is done: its outputs post-processed into the response, statistics and trace recorded,
        and the caller answered."""
        if done.cancelled():
            reply(None, asyncio.CancelledError())
            return
        try:
            try:
                result = done.result()
            except Exception as e:  # noqa: BLE001 - the engine refusing the request's data is the client's error
                raise request_io.execution_error(model, e) from None
            if result.outputs is DELIVERED:  # the executor answered the frontend (no trace, cache or destinations)
                model.statistics.record_success(batch, time.perf_counter_ns() - started, result.times, requests)
                reply(DELIVERED, None)
                return
            if trace:
                trace.mark("COMPUTE_END")
                times = result.times
                trace.executed(result.batch_size or batch, times.queue_ns, times.compute_input_ns,
                               times.compute_infer_ns)
                trace.record_tensors("TENSOR_BACKEND_OUTPUT", [(o.name, datatype_of_numpy(result.outputs[o.name].dtype),
                                                                result.outputs[o.name])
                                                               for o in requested if o.name in result.outputs])
            t0 = time.perf_counter_ns()
            outputs = request_io.outputs(self.system_shm, model, requested, result.outputs, destinations)
            result.times.compute_output_ns = time.perf_counter_ns() - t0
        except Exception as e:  # noqa: BLE001 - the caller hears it
            model.statistics.record_failure(time.perf_counter_ns() - started, requests)
            reply(None, e)
            return
        self._store(model, cached, result.outputs, requested)
        model.statistics.record_success(batch, time.perf_counter_ns() - started, result.times, requests)
        if trace:
            trace.mark("REQUEST_END")
            self.trace.finish(trace)
        reply(InferResponse(model.name, str(model.version), outputs, id=request.id), None)

    # -- response cache (server/core/response_cache.py) ----------------------------------------------------
    def caches_responses(self, model: ServedModel) -> bool:
        """Whether `model`'s requests go through the response cache: the server has one and the model's config
        enables it (Triton needs both)."""
        return self.response_cache is not None and model.config.response_cache.enable

    def _look_up(self, model: ServedModel, request: InferRequest, inputs: dict[str, Any],
                 requested: list[RequestedOutput], requests: int) -> Lookup | None:
        """The checked request's look in the cache; None when it bypasses the cache: the model does not use it, a
        tensor is in CUDA shared memory (Triton caches host memory only), the request is a step of a sequence (an
        ensemble with a stateful step: its answer depends on more than its inputs), or a frontend's group (its
        members go one by one for cached models: `submit_infer_group`)."""
        if (requests != 1 or not self.caches_responses(model) or request_io.uses_cuda_memory(self.system_shm, request, requested)
                or any(request.parameters.get(p) for p in SEQUENCE_PARAMETERS)):
            return None
        return self.response_cache.lookup(model.name, model.version, inputs,  # type: ignore[union-attr]
                                          [o.name for o in requested])

    def _answer_cached(self, model: ServedModel, request: InferRequest, requested: list[RequestedOutput],
                       cached: Lookup, trace, started: int, reply: Answer) -> None:
        """A cache hit: the stored outputs post-processed as this request asks (classification, shared memory)
        and answered without running the model; statistics as Triton counts a hit (success, queue, cache_hit;
        no inference or execution)."""
        try:
            outputs = [request_io.output(self.system_shm, model, o, cached.outputs[o.name]) for o in requested]  # type: ignore[index]
        except Exception as e:  # noqa: BLE001 - the caller hears it
            model.statistics.record_failure(time.perf_counter_ns() - started)
            reply(None, e)
            return
        model.statistics.record_cache_hit(time.perf_counter_ns() - started, cached.hash_ns, cached.lookup_ns)
        if trace:
            trace.mark("REQUEST_END")
            self.trace.finish(trace)
        reply(InferResponse(model.name, str(model.version), outputs, id=request.id), None)

    def _store(self, model: ServedModel, cached: Lookup | None, arrays: dict[str, Any],
               requested: list[RequestedOutput]) -> None:
        """After a miss: the outputs go into the cache (`store_outputs`), unless the model was reloaded meanwhile."""
        if cached is None:
            return
        entry = self.models.get(model.name)
        if entry is not None and entry.versions.get(model.version) is model:  # not reloaded meanwhile
            store_outputs(self.response_cache, model, cached, arrays, [o.name for o in requested])  # type: ignore[arg-type]

    def _forget_responses(self, name: str) -> None:
        """A model loaded again (maybe from other files) or unloaded: its cached responses go."""
        if self.response_cache is not None:
            self.response_cache.forget(name)

    # -- repository -----------------------------------------------------------------------------------------
    async def repository_index(self, ready: bool = False) -> list[dict[str, Any]]:
        """Every model in the repositories (and uploaded ones): name, version, state, reason."""
        names = sorted(set(self.repository.names()) | set(self.models))
        index = []
        for name in names:
            entry = self.models.get(name)
            if entry is not None and entry.versions:
                for version in sorted(entry.versions):
                    index.append({"name": name, "version": str(version), "state": entry.state,
                                  "reason": "" if entry.state == ModelState.READY else entry.reason})
            else:
                state, reason = (entry.state, entry.reason) if entry else (ModelState.UNAVAILABLE, "unloaded")
                index.append({"name": name, "version": "", "state": state, "reason": reason})
        if ready:
            index = [m for m in index if m["state"] == ModelState.READY]
        return index

    def _require_explicit(self) -> None:
        """Triton's words (model_repository_manager.cc LoadUnloadModel), which it uses in mode none as well."""
        if self.options.model_control_mode != "explicit":
            raise unavailable("explicit model load / unload is not allowed if polling is enabled (model control "
                              f"mode is '{self.options.model_control_mode}'; start the server with "
                              "--model-control-mode explicit)")

    async def load_model(self, name: str, config: str | None = None, files: dict[str, bytes] | None = None) -> None:
        """Load (or reload) `name`; returns when it is ready. `config` is a JSON model config that overrides
        config.pbtxt; `files` (paths like "1/model.onnx" -> content) replace the model's directory and need
        `config`. Fails with the build error if the model cannot be loaded."""
        self._require_explicit()
        files = {k.removeprefix("file:"): v for k, v in (files or {}).items()}
        if files and not config:
            raise invalid(f"load of model '{name}': file contents need a 'config' parameter too")
        check_upload(name, files)
        await self._load(name, config or None, files or None)

    async def _load(self, name: str, config_json: str | None, files: dict[str, bytes] | None,
                    implicit: bool = False) -> None:
        """Load (or reload) `name`. `implicit`: only as an ensemble's composing model (see ModelEntry.explicit)."""
        entry = self.models.setdefault(name, ModelEntry(name))
        if not implicit:
            entry.explicit = True
        async with entry.lock:
            previous_state = entry.state
            entry.state, entry.reason = ModelState.LOADING, ""
            try:
                source = (self.repository.stage_upload(name, files) if files
                          else await asyncio.to_thread(self.repository.source, name))
                versions = await self._build_versions(source, config_json)
            except ServerError as e:
                if e.kind == ErrorKind.NOT_FOUND and not entry.versions:
                    del self.models[name]  # nothing by that name exists: leave no trace in the index
                    # Triton's words (model_repository_manager.cc LoadUnloadModel), then ours
                    raise not_found(f"failed to load '{name}', failed to poll from model repository: "
                                    f"{e.message}") from None
                self._load_failed(entry, previous_state, e.message)
                raise invalid(f"load failed for model '{name}': {e.message}") from None
            except kiln.KilnError as e:
                self._load_failed(entry, previous_state, str(e))
                raise invalid(f"load failed for model '{name}': {e}") from None
            except Exception as e:  # noqa: BLE001 - a model must never take the server down
                log.exception("unexpected error while loading model '%s'", name)
                self._load_failed(entry, previous_state, f"internal error: {type(e).__name__}: {e}")
                raise ServerError(ErrorKind.INTERNAL, f"load failed for model '{name}': internal error") from None
            old = entry.versions
            entry.versions = versions
            entry.state, entry.reason = ModelState.READY, ""
            for version in old.values():
                version.close()
            self._forget_responses(name)
            log.info("successfully loaded model '%s' versions %s", name, sorted(versions))
        freeze_long_lived()

    def _load_failed(self, entry: ModelEntry, previous_state: str, reason: str) -> None:
        """Keep serving the old versions if a reload failed; otherwise the model is UNAVAILABLE with the reason."""
        if entry.versions:
            entry.state, entry.reason = previous_state, ""
            log.error("reload of model '%s' failed, the loaded versions keep serving: %s", entry.name, reason)
        else:
            entry.state, entry.reason = ModelState.UNAVAILABLE, reason
            log.error("failed to load model '%s': %s", entry.name, reason)

    async def _build_versions(self, source: ModelSource, config_json: str | None) -> dict[int, ServedModel]:
        if config_json is not None:
            config = parse_config_json(config_json, source.name)
        elif source.config_text is not None:
            config = parse_config_text(source.config_text, source.name)
        else:
            config = ModelConfig()
        self.config_fields.check(config, source.name)  # once per load, for every kind of model, before any build
        if config.model_repository_agents.agents:  # Triton's checksum agent: the files as the config says, or no load
            await asyncio.to_thread(repository_agents.run_agents, config, source.directory)
        if config.response_cache.enable and self.response_cache is None:
            log.warning("model '%s' enables response_cache, but the server has no cache: its requests are not "
                        "cached (start the server with --cache-config local,size=<bytes>)", source.name)
        if not source.versions:
            raise invalid(f"model '{source.name}' has no version directories (expected {source.directory}/1/...)")
        config.name = config.name or source.name
        if not generative.is_generative(config) and is_ensemble(config):  # no model file (empty versions, as Triton)
            return await self._build_ensemble(source, config)  # no load slot: it waits for its composing models
        if self._load_slots is None:  # --model-load-thread-count; made here, on the event loop
            self._load_slots = asyncio.Semaphore(max(self.options.load_concurrency, 1))
        async with self._load_slots:
            return await self._build_model_versions(source, config)

    async def _build_model_versions(self, source: ModelSource, config: ModelConfig) -> dict[int, ServedModel]:
        """The versions of a model that is not an ensemble (a decoder, a Python model, an ONNX model)."""
        if generative.is_generative(config):  # a decoder served by its own generation loop (core/generative.py)
            return await generative.load_versions(source, config, self.options.default_max_batch_size)
        with_default_execution_timeout(config, self.options.execution_timeout_ms)
        if runs_python(config, source):  # model.py in stub processes of its own (server/core/python_model.py)
            return await load_python_versions(source, config, self)
        wanted = select_versions(config.version_policy, list(source.versions))
        versions = await load_together(asyncio.to_thread(load_model_version, source, v, config,
                                                         self.options.default_max_batch_size) for v in wanted)
        for version in versions.values():  # the core's request path warm too before ready (warmup.prime_request_path)
            await warmup.prime_request_path(version, self._checked, functools.partial(request_io.outputs, self.system_shm))
        return dict(versions)

    async def _build_ensemble(self, source: ModelSource, config: ModelConfig) -> dict[int, ServedModel]:
        """An ensemble's versions, checked against its composing models, which are loaded with it when they are
        not yet (Triton polls and loads an ensemble's composing models with it, explicit mode included)."""
        name = source.name
        config = complete_ensemble_config(config, name)
        wanted = select_versions(config.version_policy, list(source.versions))
        composing = sorted({step.model_name for step in config.ensemble_scheduling.step})
        self._check_no_cycle(name, composing)
        self._ensembles_loading[name] = set(composing)
        try:
            loaded = await asyncio.gather(*(self._composing_versions(name, c) for c in composing))
        finally:
            del self._ensembles_loading[name]
        versions = dict(zip(composing, loaded))
        return {v: EnsembleVersion(name, v, config, versions) for v in wanted}

    def _check_no_cycle(self, ensemble: str, composing: list[str]) -> None:
        """Refuse an ensemble that would run itself, directly or through other ensembles: it could never finish
        loading (each waits for the other) nor running."""
        edges = {name: set().union(*(v.composing_names for v in entry.versions.values()
                                     if isinstance(v, EnsembleVersion)))
                 for name, entry in self.models.items()}
        edges.update(self._ensembles_loading)
        for name in composing:
            path = dependency_path(edges, name, ensemble)
            if path is not None:
                raise invalid(f"ensemble '{ensemble}' has a cycle: it runs {' -> '.join(path)}, which runs it again")

    async def _composing_versions(self, ensemble: str, name: str) -> dict[int, ServedModel]:
        """The loaded versions of composing model `name`: waited for if it is loading (its outcome is taken as it
        is, not tried again), loaded if it is not."""
        startup = next((t for n, t in zip(self._startup_names, self._startup) if n == name and not t.done()), None)
        entry = self.models.get(name)
        busy = startup is not None or (entry is not None and entry.lock.locked())
        if startup is not None:
            await asyncio.shield(startup)  # its start-up load is under way: wait rather than build it twice
        elif entry is not None and busy:
            async with entry.lock:  # a load (or unload) of it is under way
                pass
        entry = self.models.get(name)
        if not busy and (entry is None or not entry.versions):
            if name not in self.repository.names():  # Triton's text (model_repository_manager.cc)
                raise invalid(f"ensemble {ensemble} contains models that are not available or ambiguous: {name}")
            with contextlib.suppress(ServerError):  # the reason is in the entry; the message below gives it
                await self._load(name, None, None, implicit=True)
            entry = self.models.get(name)
        if entry is None or not entry.versions:
            failed = (f" Model '{name}' loading failed with error: {entry.reason}"
                      if entry is not None and entry.reason not in ("", "unloaded") else "")
            raise invalid(f"ensemble '{ensemble}' depends on '{name}' which has no loaded version.{failed}")
        return dict(entry.versions)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """Stop serving `name`; requests already running finish. Unloading an unloaded model is a no-op.
        `unload_dependents`: an ensemble's composing models go too, unless they were loaded by themselves or
        another loaded ensemble runs them (Triton's rule)."""
        self._require_explicit()
        if name not in self.models and name not in self.repository.names():
            raise not_found(unknown_model(name))
        composing = self._composing_of(name)
        await self._unload(name)
        if unload_dependents:
            await self._unload_composing(composing)

    async def _unload(self, name: str, reason: str = "unloaded") -> None:
        """Unload `name`; the loaded ensembles that run it become UNAVAILABLE too, with Triton's reason."""
        entry = self.models.get(name)
        if entry is None:
            return
        async with entry.lock:
            versions, entry.versions = entry.versions, {}
            entry.state, entry.reason = ModelState.UNAVAILABLE, reason
            entry.explicit = False
            for version in versions.values():
                version.close()
            self._forget_responses(name)
        log.info("successfully unloaded model '%s'%s", name, "" if reason == "unloaded" else f" ({reason})")
        for dependent in self._dependents_of(name):
            await self._unload(dependent, f"ensemble '{dependent}' depends on '{name}' which has no loaded version")
        freeze_long_lived()

    def _composing_of(self, name: str) -> set[str]:
        """The models the loaded versions of ensemble `name` run (empty for any other model)."""
        entry = self.models.get(name)
        versions = entry.versions.values() if entry else ()
        return set().union(*(v.composing_names for v in versions if isinstance(v, EnsembleVersion)))

    def _dependents_of(self, name: str) -> list[str]:
        """The loaded ensembles that run `name`."""
        return sorted(ensemble for ensemble, entry in self.models.items()
                      if entry.versions and name in self._composing_of(ensemble))

    async def _unload_composing(self, names: set[str]) -> None:
        """unload_dependents: the composing models loaded only for an ensemble that no loaded ensemble runs now,
        and theirs in turn (nested ensembles)."""
        for name in sorted(names):
            entry = self.models.get(name)
            if entry is None or not entry.versions or entry.explicit or self._dependents_of(name):
                continue
            inner = self._composing_of(name)
            await self._unload(name)
            await self._unload_composing(inner)

    # -- adaptive profiles ----------------------------------------------------------------------------------
    async def _adapt_profiles_forever(self) -> None:
        """Every interval, refit each loaded version that has seen `min_requests` requests since its last fit."""
        settings = self.options.adaptive
        while True:
            await asyncio.sleep(settings.interval_s)
            for name, entry in list(self.models.items()):
                for number, model in list(entry.versions.items()):
                    if (not isinstance(model, ModelVersion) or not model.profiles_matter
                            or model.traffic.requests - model.traffic_at_fit < settings.min_requests):
                        continue
                    try:
                        await self.refit_profiles(name, number)
                    except Exception as e:  # noqa: BLE001 - a failed rebuild keeps the current plan serving
                        log.error("adaptive profiles: rebuild of model '%s' version %d failed, the current plan "
                                  "keeps serving: %s", name, number, e)

    async def refit_profiles(self, name: str, version: int) -> bool:
        """Fit profiles to the traffic `name`/`version` has seen; if they differ from its plan's, build a plan
        with them in the background and swap it in. Requests already queued finish on the old plan (it is
        closed, not dropped) and new ones go to the new plan, so none fail. True when a new plan was swapped in.
        """
        entry = self.models.get(name)
        if entry is None:
            return False
        async with entry.lock:
            old = entry.versions.get(version)
            if not isinstance(old, ModelVersion) or old.source is None or old.requested_config is None:
                return False
            old.traffic_at_fit = old.traffic.requests
            fitted = fit_profiles(old.traffic, old.profile_ranges(), self.options.adaptive.max_profiles)
            if fitted is None or close_enough(fitted, old.current_profiles()):
                return False
            new = await asyncio.to_thread(load_model_version, old.source, version, old.requested_config,
                                          self.options.default_max_batch_size, fitted)
            if entry.versions.get(version) is not old:  # unloaded or reloaded meanwhile: the fit is stale
                new.close()
                return False
            new.adopt(old)
            new.traffic_at_fit = old.traffic_at_fit
            entry.versions[version] = new
            old.close()
        log.info("adaptive profiles: model '%s' version %d now runs a plan with %d profiles fitted to %d requests "
                 "(%s)", name, version, len(fitted), new.traffic.requests, describe(fitted))
        return True

    # -- statistics -----------------------------------------------------------------------------------------
    def loaded_versions(self) -> list[ServedModel]:
        return [v for entry in self.models.values() for _, v in sorted(entry.versions.items())]

    async def model_statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        """Triton's `{"model_stats": [...]}` for all models, one model, or one version."""
        if not name:
            return {"model_stats": [v.statistics.as_dict() for v in self.loaded_versions()]}
        # Triton's texts and INVALID_ARGUMENT (HTTP 400) for a model or version it has no statistics of
        # (core/src/tritonserver.cc TRITONSERVER_ServerModelStatistics)
        entry = self.models.get(name)
        if entry is None or not entry.versions:
            raise invalid(f"requested model '{name}' is not available")
        if version:
            try:
                return {"model_stats": [self._version(name, version).statistics.as_dict()]}
            except ServerError:
                raise invalid(f"requested model version is not available for model '{name}'") from None
        return {"model_stats": [v.statistics.as_dict() for _, v in sorted(entry.versions.items())]}

    # -- shared memory --------------------------------------------------------------------------------------
    async def system_shared_memory_status(self, name: str = "") -> list[dict[str, Any]]:
        return self.system_shm.status(name)

    def _require_client_shm(self) -> None:
        """Register and unregister need --allow-client-shm; status stays answerable (Triton: http_server.cc)."""
        if not self.options.allow_client_shm:
            raise unimplemented(CLIENT_SHM_DISABLED)

    async def register_system_shared_memory(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._require_client_shm()
        await asyncio.to_thread(self.system_shm.register, name, key, int(offset), int(byte_size))

    async def unregister_system_shared_memory(self, name: str = "") -> None:
        self._require_client_shm()
        self.system_shm.unregister(name)

    async def cuda_shared_memory_status(self, name: str = "") -> list[dict[str, Any]]:
        return self.system_shm.cuda_status(name)

    async def register_cuda_shared_memory(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self._require_client_shm()
        await asyncio.to_thread(self.system_shm.register_cuda, name, bytes(raw_handle), int(device_id), int(byte_size))

    async def unregister_cuda_shared_memory(self, name: str = "") -> None:
        self._require_client_shm()
        await asyncio.to_thread(self.system_shm.unregister_cuda, name)

    # -- settings -------------------------------------------------------------------------------------------
    async def trace_settings(self, model_name: str = "", updates: dict[str, Any] | None = None) -> dict[str, Any]:
        """Current trace settings (global or for a model), after applying `updates` if given."""
        if model_name and model_name not in self.models and model_name not in self.repository.names():
            raise not_found(unknown_model(model_name))
        return self.trace.update(model_name, updates) if updates else self.trace.current(model_name)

    async def log_settings(self, updates: dict[str, Any] | None = None) -> dict[str, Any]:
        """Current log settings after applying `updates` (they take effect on Python logging at once)."""
        return self.logging.update(updates) if updates else self.logging.current()
