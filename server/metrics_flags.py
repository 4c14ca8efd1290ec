"""Triton's metrics flags: `--metrics-config`, `--metrics-interval-ms`, `--allow-gpu-metrics`, `--allow-cpu-metrics`.

`--allow-metrics` and `--metrics-port` stay in cli.py with the other listeners' flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from server.core.latency import MetricsConfig, parse_metrics_config
from server.flags import parse_bool


@dataclass(frozen=True)
class MetricsOptions:
    """What the metrics endpoint exports, and how often per-interval values (CPU, GPU) are read again."""

    config: MetricsConfig = field(default_factory=MetricsConfig)
    allow_gpu: bool = True
    allow_cpu: bool = True
    interval_s: float = 2.0


def _interval_ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected milliseconds > 0, got '{text}'")
    return value


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics-config", action="append", default=[], metavar="<setting>=<value>",
                        help="Triton's metrics settings (repeatable): summary_latencies=true (latency quantiles "
                             "over the last 60 s), summary_quantiles=<q>:<error>,..., histogram_latencies=true "
                             "(first-response histogram), counter_latencies=false")
    parser.add_argument("--metrics-interval-ms", type=_interval_ms, default=2000.0, metavar="MS",
                        help="CPU and GPU metrics are read at most once per this many milliseconds (default 2000)")
    parser.add_argument("--allow-gpu-metrics", type=parse_bool, default=True, metavar="BOOL",
                        help="export nv_gpu_* and nv_energy_consumption through NVML (needs kiln[gpu])")
    parser.add_argument("--allow-cpu-metrics", type=parse_bool, default=True, metavar="BOOL",
                        help="export nv_cpu_utilization and nv_cpu_memory_*")


def metrics_options_from_args(args: argparse.Namespace) -> MetricsOptions:
    """The parsed flags; ValueError for a bad --metrics-config."""
    return MetricsOptions(parse_metrics_config(list(args.metrics_config)), args.allow_gpu_metrics,
                          args.allow_cpu_metrics, args.metrics_interval_ms / 1000.0)
