"""Triton's `--trace-config` flag: global settings (`rate`, `level`, `count`, `mode`), `triton,file=...` /
`triton,log-frequency=...`, and `opentelemetry,url=...` / `resource=<key>=<value>` / `bsp_*` (server/core/otel.py).

Applied to the core's trace settings at start-up, before any request; the same settings the trace extension
(`/v2/trace/setting`) reads and updates later. A setting Triton does not have is refused rather than ignored.
"""

from __future__ import annotations

import argparse

from server.core.errors import ServerError
from server.core.otel import OtelExporter, OtelSettings
from server.core.settings import TraceSettings

_GLOBAL = {"rate": "trace_rate", "level": "trace_level", "count": "trace_count", "mode": "trace_mode"}
_TRITON = {"file": "trace_file", "log-frequency": "log_frequency"}


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace-config", action="append", default=[], metavar="[<mode>,]<setting>=<value>",
                        help="Triton's tracing settings (repeatable): rate=N, level=TIMESTAMPS|TENSORS|OFF, count=N, "
                             "mode=triton|opentelemetry; triton,file=PATH, triton,log-frequency=N; "
                             "opentelemetry,url=URL, opentelemetry,resource=KEY=VALUE, "
                             "opentelemetry,bsp_max_queue_size|bsp_schedule_delay|bsp_max_export_batch_size=N "
                             "(opentelemetry needs kiln[otel])")
    # Triton's older trace flags, still accepted by tritonserver: each is the --trace-config setting it names
    for flag, (setting, metavar) in LEGACY_TRACE_FLAGS.items():
        parser.add_argument(flag, action="append" if flag == "--trace-level" else None, default=None,
                            metavar=metavar, help=f"the same as --trace-config {setting}{metavar}")


#: tritonserver's deprecated trace flags -> (the --trace-config setting each sets, its value's metavar)
LEGACY_TRACE_FLAGS = {"--trace-file": ("triton,file=", "PATH"), "--trace-level": ("level=", "LEVEL"),
                      "--trace-rate": ("rate=", "N"), "--trace-count": ("count=", "N"),
                      "--trace-log-frequency": ("triton,log-frequency=", "N")}


def trace_settings(args: argparse.Namespace) -> list[str]:
    """Every trace setting of the command line as --trace-config entries: the older flags' first, so that a
    --trace-config of the same setting wins."""
    settings = []
    for flag, (setting, _) in LEGACY_TRACE_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        for item in (value if isinstance(value, list) else [] if value is None else [value]):
            settings.append(f"{setting}{item}")
    return settings + list(args.trace_config)


def parse_trace_config(settings: list[str]) -> tuple[dict[str, object], OtelSettings]:
    """The flags as trace-setting updates and OpenTelemetry settings; ValueError on a bad one."""
    updates: dict[str, object] = {}
    levels: list[str] = []
    otel = OtelSettings()
    for text in settings:
        head = text.split("=", 1)[0]
        mode, _, rest = text.partition(",") if "," in head else ("", "", text)
        key, sep, value = rest.partition("=")
        if not sep or not key or not value or (not mode and "," in head):
            raise ValueError(f"--trace-config option format is '<trace mode>,<setting>=<value>' or "
                             f"'<setting>=<value>'. Got {text}")
        if mode == "" and key in _GLOBAL:
            if key == "level":
                levels.append(value.upper())
            else:
                updates[_GLOBAL[key]] = value
        elif mode == "triton" and key in _TRITON:
            updates[_TRITON[key]] = value
        elif mode == "opentelemetry":
            try:
                otel.set(key, value)
            except ServerError as e:
                raise ValueError(e.message) from None
        elif mode not in ("", "triton", "opentelemetry"):
            raise ValueError(f"invalid value for trace mode option: {mode}. Available options are \"triton\" and "
                             "\"opentelemetry\"")
        else:
            raise ValueError(f"Bad option: \"--trace-config {text}\": unknown setting '{key}'")
    if levels:  # Triton ORs the levels given; OFF alone turns tracing off
        updates["trace_level"] = [level for level in levels if level != "OFF"] or ["OFF"]
    return updates, otel


def apply_trace_config(trace: TraceSettings, settings: list[str]) -> None:
    """`--trace-config` applied to the server's trace settings; ValueError for a bad setting, or for mode
    opentelemetry without the OpenTelemetry SDK (the message names the `kiln[otel]` extra)."""
    if not settings:
        return
    updates, otel = parse_trace_config(settings)
    try:
        if updates.get("trace_mode") == "opentelemetry":
            trace.otel = OtelExporter(otel)
        trace.update("", updates)
    except ServerError as e:
        raise ValueError(f"--trace-config: {e.message}") from None
