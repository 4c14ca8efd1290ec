"""`kiln serve` / `python -m server`: flags -> `CoreOptions`, then HTTP, gRPC and metrics on one event loop.

Flags follow Triton's (`--model-repository`, `--http-port`, `--grpc-port`, `--metrics-port`,
`--model-control-mode`, `--load-model`, `--strict-readiness`, `--log-verbose`, ...), so scripts carry over.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import ssl
import sys

from server import plan_cache
from server.auth import add_auth_arguments, restrictions_from_args
from server.core import CoreOptions, ServerCore, build_process, latency
from server.core.executor_wire import SWITCH_INTERVAL_S
from server.core.heap import freeze_long_lived, keep_large_buffers_in_heap
from server.core.limits import InflightLimiter, add_limit_arguments, limits_from_args
from server.core.placement import restricted_visible_devices
from server.core.response_cache import CacheConfig, parse_cache_config
from server.core.settings import AdaptiveSettings
from server.core.tensor_arena import DEFAULT_ARENA_MB
from server.flags import parse_bool as _bool
from server.frontend_processes import FrontendPool, frontend_count
from server.lifecycle import Lifecycle, add_drain_arguments, drain_settings
from server.listeners import Listeners, make_uvicorn, reload_certificates, serve_listener, start_listeners
from server.metrics_flags import add_metrics_arguments, metrics_options_from_args
from server.repository import configure_config_name, configure_watch
from server.tls import add_tls_arguments, tls_from_args
from server.trace_flags import add_trace_arguments, apply_trace_config, trace_settings
from server.triton_flags import add_triton_flags, check_triton_flags

log = logging.getLogger("kiln.server")

# sys.setswitchinterval(SWITCH_INTERVAL_S): how long a thread may hold the interpreter lock while another waits for
# it (Python's default: 5 ms). The execution workers release the lock in every CUDA call and need it back to go on;
# with 5 ms, an execution of a dozen calls could wait tens of ms for the event loop's threads (docs/performance.md).
# 200 us bounds that wait at a cost of a few us per forced switch. KILN_SWITCH_INTERVAL_US sets another value.


def _memory_size(text: str) -> int:
    """A `--build-memory-limit` value in bytes; 0 means no limit."""
    try:
        return build_process.parse_size(text) or 0
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_ms(text: str) -> float:
    """An `--execution-timeout-ms` value: milliseconds >= 0 (0: no limit)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected milliseconds >= 0, got '{text}'")
    return value


def _positive_count(text: str) -> int:
    """A count >= 1 (`--model-load-thread-count`)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1, got '{text}'")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the serve flags to `parser` (used by `kiln serve` and `python -m server`)."""
    parser.add_argument("--model-repository", "--model-store", action="append", required=True, metavar="DIR",
                        help="model repository directory (repeatable)")
    parser.add_argument("--host", "--http-address", dest="host", default="0.0.0.0",
                        help="address the HTTP server listens on (and gRPC and metrics, unless given their own)")
    parser.add_argument("--grpc-address", default=None, metavar="ADDRESS",
                        help="address the gRPC server listens on (default: --http-address's)")
    parser.add_argument("--metrics-address", default=None, metavar="ADDRESS",
                        help="address the metrics server listens on (default: --http-address's)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--allow-http", type=_bool, default=True, metavar="BOOL")
    parser.add_argument("--allow-grpc", type=_bool, default=True, metavar="BOOL")
    parser.add_argument("--allow-metrics", type=_bool, default=True, metavar="BOOL")
    parser.add_argument("--model-control-mode", choices=["none", "explicit", "poll"], default="none",
                        help="none: load every model at start; explicit: load/unload through the API; "
                             "poll: load at start, then follow the repository directory")
    parser.add_argument("--repository-poll-secs", type=float, default=15.0, metavar="SECONDS",
                        help="poll mode: how often the repository is scanned for added/changed/removed models")
    parser.add_argument("--adaptive-profiles", action="store_true",
                        help="refit optimization profiles to the request shapes seen and hot-swap the rebuilt plan")
    parser.add_argument("--adaptive-profiles-interval-secs", type=float, default=60.0,
                        help="how often each model's traffic is looked at (default 60)")
    parser.add_argument("--adaptive-profiles-min-requests", type=int, default=1000,
                        help="requests seen since the last fit before a model is refitted (default 1000)")
    parser.add_argument("--adaptive-profiles-max", type=int, default=4,
                        help="quantile cuts per variable dim (default 4)")
    parser.add_argument("--repository-watch", type=_bool, default=True, metavar="BOOL",
                        help="poll mode: also rescan on file-system events (needs the watchfiles package), so a "
                             "model copied into the repository loads within a second")
    parser.add_argument("--plan-cache-dir", default=None, metavar="DIR",
                        help="built plans are cached here (default $KILN_CACHE_DIR/plans or "
                             "~/.cache/kiln/plans; '' disables the cache)")
    parser.add_argument("--build-memory-limit", type=_memory_size, default=None, metavar="SIZE",
                        help="memory one model build may use (e.g. 8G, 512M; 0 = no limit); a build past it "
                             "fails and the model is UNAVAILABLE (default: half of this machine's memory)")
    parser.add_argument("--build-timeout-secs", type=float, default=build_process.DEFAULT_TIMEOUT_S,
                        metavar="SECONDS", help="a model build running longer is stopped and fails (0 = no limit)")
    parser.add_argument("--load-model", action="append", default=[], metavar="NAME",
                        help="explicit mode: model to load at start ('*' = all; repeatable)")
    parser.add_argument("--strict-readiness", type=_bool, default=True, metavar="BOOL",
                        help="ready only when every model loaded at start is ready")
    parser.add_argument("--exit-on-error", type=_bool, default=True, metavar="BOOL",
                        help="exit (code 1) when a model loaded at start fails to load, as Triton does by default; "
                             "false: serve the models that loaded")
    parser.add_argument("--model-load-thread-count", type=_positive_count, default=4, metavar="N",
                        help="at most N models load at once (Triton's default: 4; an ensemble itself takes no "
                             "turn, its composing models do)")
    parser.add_argument("--model-config-name", default="", metavar="NAME",
                        help="read each model's configs/NAME.pbtxt where it has one, else its config.pbtxt (Triton's "
                             "custom model configurations)")
    parser.add_argument("--id", default=None, metavar="NAME",
                        help="the server's name in its metadata (GET /v2, ServerMetadata; default 'kiln')")
    parser.add_argument("--default-max-batch-size", type=int, default=4,
                        help="max_batch_size given to models whose config leaves it out and that batch")
    parser.add_argument("--execution-timeout-ms", type=_positive_ms, metavar="MS",
                        default=_positive_ms(os.environ.get("KILN_EXECUTION_TIMEOUT_MS", "0")),
                        help="kiln_execution_timeout_ms for models whose config leaves it out: an execution running "
                             "longer fails its requests (503) and its worker waits out of service; 0: no limit "
                             "(default; env KILN_EXECUTION_TIMEOUT_MS)")
    parser.add_argument("--allow-client-shm", type=_bool, default=False, metavar="BOOL",
                        help="let clients register, unregister and use system and CUDA shared-memory regions "
                             "(Triton's flag and default: false; status queries are always answered)")
    parser.add_argument("--lenient-config", action="store_true",
                        help="load models whose config sets fields Kiln refuses (sequence_batching, decoupled, "
                             "rate_limiter, ...: docs/server.md lists them), logging one warning per model and "
                             "field and ignoring the field; without it such a model fails to load and is UNAVAILABLE "
                             "with the reason")
    parser.add_argument("--cache-config", action="append", default=[], metavar="<cache>,<key>=<value>",
                        help="Triton's response cache: --cache-config local,size=<bytes> keeps responses of models "
                             "whose config has response_cache { enable: true } in a cache of that many bytes of host "
                             "memory shared by all models, and answers repeated requests from it")
    parser.add_argument("--response-cache-byte-size", type=int, default=None, metavar="BYTES",
                        help="deprecated (as in Triton): the same as --cache-config local,size=BYTES (0: no cache)")
    parser.add_argument("--log-verbose", type=int, default=0, metavar="LEVEL")
    for level in ("info", "warning", "error"):
        parser.add_argument(f"--log-{level}", type=_bool, default=None, metavar="BOOL",
                            help=f"log {level} messages (default true; the logging extension can change it later)")
    parser.add_argument("--log-file", default="", help="write the server log to this file instead of stderr")
    parser.add_argument("--log-format", choices=["default", "ISO8601"], default="default")
    parser.add_argument("--frontend-processes", type=frontend_count, default="auto", metavar="N|auto",
                        help="serve HTTP and gRPC from N child processes sharing the ports, the models from this one "
                             "(protocol work then runs beside the GPU workers instead of taking their interpreter "
                             "lock; H100, BERT at 64 clients: 2.3-2.9x the requests/s of 0); 'auto' (default): "
                             "one per two cores beyond the first on machines with 4 or more, at most 8; 0: HTTP "
                             "and gRPC in this process")
    parser.add_argument("--frontend-arena-mb", type=float, default=DEFAULT_ARENA_MB, metavar="MB",
                        help="shared memory per frontend process through which large request tensors reach the "
                             "model process (server/core/tensor_arena.py; page-locked for CUDA models, which then "
                             "read them on the device); 0: through the socket, as small ones go")
    parser.add_argument("--gpu-executor", choices=["process", "thread"], default=None,
                        help="where executions of CUDA models that batch run: 'process' (default; also "
                             "KILN_EXECUTOR): one executor process per model version, out of this process's "
                             "interpreter lock, restarted if it dies (server/core/executor.py); 'thread': worker "
                             "threads of this process, as before")
    parser.add_argument("--gpus", default=None, metavar="IDS",
                        help="serve on these GPUs only, e.g. 0,1: sets CUDA_VISIBLE_DEVICES before any CUDA call "
                             "(the ids index an existing CUDA_VISIBLE_DEVICES when set); instance_group gpus then "
                             "count within them (docs/server.md, Several GPUs)")
    add_drain_arguments(parser)
    add_limit_arguments(parser)
    add_auth_arguments(parser)
    add_tls_arguments(parser)
    add_metrics_arguments(parser)
    add_trace_arguments(parser)
    add_triton_flags(parser)


def restrict_gpus(ids: str | None) -> None:
    """`--gpus IDS`: CUDA_VISIBLE_DEVICES narrowed to those devices (ValueError for bad ids). Must run before
    anything initialises CUDA: the driver reads the variable once."""
    if ids is None:
        return
    visible = restricted_visible_devices(ids, os.environ.get("CUDA_VISIBLE_DEVICES"))
    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    log.info("--gpus %s: CUDA_VISIBLE_DEVICES=%s", ids, visible)


def build_limits(args: argparse.Namespace) -> build_process.BuildLimits:
    """The bounds every model build runs under (builds run in child processes: server/core/build_process.py)."""
    memory = build_process.default_memory_limit() if args.build_memory_limit is None else args.build_memory_limit
    return build_process.BuildLimits(memory or None, args.build_timeout_secs or None)


def core_options(args: argparse.Namespace) -> CoreOptions:
    return CoreOptions(
        model_repositories=list(args.model_repository),
        model_control_mode=args.model_control_mode,
        repository_poll_secs=args.repository_poll_secs,
        startup_models=list(args.load_model),
        default_max_batch_size=args.default_max_batch_size,
        execution_timeout_ms=args.execution_timeout_ms or None,
        strict_readiness=args.strict_readiness,
        load_concurrency=args.model_load_thread_count,
        server_id=args.id,
        log_verbose=args.log_verbose,
        log_file=args.log_file,
        log_format=args.log_format,
        adaptive=_adaptive(args),
        allow_client_shm=args.allow_client_shm,
        lenient_config=args.lenient_config,
        response_cache=cache_config(args),
    )


def cache_config(args: argparse.Namespace) -> CacheConfig | None:
    """--cache-config, or Triton's deprecated --response-cache-byte-size; ValueError for a bad or unknown cache."""
    settings = list(args.cache_config)
    if args.response_cache_byte_size:  # 0, its old default, leaves the cache off
        if settings:  # Triton's text (command_line_parser.cc)
            raise ValueError("Incompatible flags --response-cache-byte-size and --cache-config both provided. "
                             "Please provide one or the other.")
        log.warning("'--response-cache-byte-size' has been deprecated! The equivalent --cache-config argument is "
                    "'--cache-config=local,size=%d'", args.response_cache_byte_size)
        settings = [f"local,size={args.response_cache_byte_size}"]
    return parse_cache_config(settings)


def _adaptive(args: argparse.Namespace) -> AdaptiveSettings:
    """--adaptive-profiles and its knobs; without the flag the KILN_ADAPTIVE_* environment decides."""
    if not args.adaptive_profiles:
        return AdaptiveSettings.from_env()
    return AdaptiveSettings(True, args.adaptive_profiles_interval_secs, args.adaptive_profiles_min_requests,
                            args.adaptive_profiles_max)


async def serve(args: argparse.Namespace) -> int:
    """Run until SIGINT/SIGTERM, then drain (server/lifecycle.py); returns the process exit code.

    HTTP and gRPC run in this process, or in `--frontend-processes` children (server/frontend_processes.py) while
    this one keeps the models; the metrics endpoint is always served here."""
    from server.metrics import create_metrics_app

    args.grpc_address = args.grpc_address or args.host
    args.metrics_address = args.metrics_address or args.host
    try:
        check_triton_flags(args)  # a Triton flag Kiln does not implement ends the start, naming it
        restrict_gpus(args.gpus)  # first: every CUDA call after it (this process and its children) sees only those
        limits_from_args(args)  # bad limits fail here, before anything starts
        restrictions_from_args(args)
        _, _, metrics_tls = tls_from_args(args)
        metrics_options = metrics_options_from_args(args)
        latency.configure(metrics_options.config)  # before models load: their statistics record with it
        plan_cache.configure(args.plan_cache_dir)
        if args.gpu_executor is not None:  # read where models load (server/core/executor.py `mode`)
            os.environ["KILN_EXECUTOR"] = args.gpu_executor
        build_process.configure(build_limits(args))
        configure_watch(args.repository_watch)
        configure_config_name(args.model_config_name)
        core = ServerCore(core_options(args))
        core.logging.update({f"log_{level}": getattr(args, f"log_{level}") for level in ("info", "warning", "error")
                             if getattr(args, f"log_{level}") is not None})
        apply_trace_config(core.trace, trace_settings(args))
    except (FileNotFoundError, ValueError, ssl.SSLError) as e:
        logging.getLogger("kiln").error("%s", e)
        return 2
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    keep_large_buffers_in_heap()
    warm_up = asyncio.create_task(asyncio.to_thread(build_process.warm_up))  # overlaps the listeners' start
    await core.start()
    lifecycle = Lifecycle(drain_settings(args))
    listeners = Listeners()
    pool: FrontendPool | None = None
    if args.allow_metrics:
        metrics = make_uvicorn(create_metrics_app(core, metrics_options), args.metrics_address, args.metrics_port,
                               "metrics", lifecycle.settings.timeout_s, metrics_tls)
        listeners.servers.append(metrics)
        listeners.tasks.append(asyncio.create_task(serve_listener(metrics), name="metrics"))
    stop = asyncio.Event()

    def begin_shutdown() -> None:
        core.begin_drain()  # gRPC ServerReady says no too; the HTTP middleware answers /v2/health/ready
        stop.set()

    lifecycle.install_signal_handlers(asyncio.get_running_loop(), begin_shutdown)

    def reload_tls() -> None:  # SIGHUP: certificates rotated on disk
        reload_certificates(listeners)
        if pool is not None:
            pool.forward(signal.SIGHUP)

    with contextlib.suppress(NotImplementedError, RuntimeError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_tls)
    code = 0
    try:
        if args.frontend_processes > 0 and (args.allow_http or args.allow_grpc):
            pool = FrontendPool(core, args, args.frontend_processes)
            await pool.start()
            http_port, grpc_port = pool.ports
        else:
            limiter = InflightLimiter(args.max_inflight_requests)  # one budget for HTTP and gRPC together
            started = await start_listeners(core, args, lifecycle, limiter)
            listeners.servers += started.servers
            listeners.tasks += started.tasks
            listeners.grpc_server = started.grpc_server
            http_port, grpc_port = args.http_port, args.grpc_port if started.grpc_server else "off"
        freeze_long_lived()  # the listeners' objects; models freeze theirs as they load
        log.info("serving: HTTP %s, gRPC %s, metrics %s", http_port if args.allow_http else "off",
                 grpc_port if args.allow_grpc else "off", args.metrics_port if args.allow_metrics else "off")
        waiter = asyncio.create_task(stop.wait())
        waits = [waiter] if pool is None else [waiter, asyncio.create_task(pool.failed.wait())]
        failures = asyncio.create_task(_startup_failures(core)) if args.exit_on_error else None
        waits += [failures] if failures is not None else []
        done, _ = await asyncio.wait([*waits, *listeners.tasks], return_when=asyncio.FIRST_COMPLETED)
        if failures is not None and failures in done:
            code = 1
            log.error("failed to load all models (%s); exiting (--exit-on-error true, Triton's default; "
                      "--exit-on-error false serves the models that loaded)", "; ".join(failures.result()))
        elif waiter not in done:  # a listener ended on its own (port in use, ...), or frontends could not restart
            code = 1
            log.error("a listener stopped unexpectedly; shutting down")
        for task in waits:
            task.cancel()
    except (OSError, SystemExit) as e:
        log.error("cannot start the server: %s", e)
        code = 1
    finally:
        core.begin_drain()
        build_process.stop_all()  # loads still building fail now instead of holding the exit up
        if pool is not None:
            await pool.stop(lifecycle.settings.timeout_s)
        await lifecycle.shutdown(listeners.servers, listeners.tasks, listeners.grpc_server)
        await core.stop()
        if core.trace.otel is not None:
            core.trace.otel.shutdown()  # the spans still batched leave now
        await asyncio.gather(warm_up, return_exceptions=True)
    return code


async def _startup_failures(core: ServerCore) -> list[str]:
    """The models loaded at start that failed (name: reason), once every startup load has ended; when none failed,
    it never returns (`--exit-on-error`)."""
    await core.wait_for_startup()
    if not core.startup_failures:
        await asyncio.Event().wait()
    return list(core.startup_failures)


def run_serve(args: argparse.Namespace) -> int:
    """Entry point of `kiln serve`: run the server until interrupted; returns the exit code."""
    try:
        return run_event_loop(serve(args))
    except KeyboardInterrupt:
        return 0


def run_event_loop(main_coroutine) -> int:
    """uvloop when installed (less event-loop CPU per request: docs/performance.md), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main_coroutine)
    return uvloop.run(main_coroutine)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server", description="Kiln inference server")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))
