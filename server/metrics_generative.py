"""Metric families of generative models (server/core/generative.py), labelled model and version, read at scrape time.

The KV-cache and sequence gauges and the token counters (the prefix cache's in prompt tokens, as vLLM's) come from
each version's `Generator.stats()`; the time to first token and inter-token latency histograms from the version's
own `Histogram`s (seconds, Prometheus naming).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import Metric

from server.core.generative import GenerativeVersion
from server.core.latency import Histogram
from server.core.metric_samples import add_histogram

#: gauge or counter name -> (help, type, extra labels, how to read it from a version's GeneratorStats)
_FAMILIES: dict[str, tuple[str, str, list[tuple[dict[str, str], Callable[[Any], float]]]]] = {
    "kiln_kv_cache_blocks_used": ("KV-cache blocks held by sequences", "gauge", [({}, lambda s: s.kv_blocks_used)]),
    "kiln_kv_cache_blocks_total": ("KV-cache blocks in the pool", "gauge", [({}, lambda s: s.kv_blocks_total)]),
    "kiln_generation_sequences": ("Sequences generating (running) or queued for KV-cache blocks and a batch slot "
                                  "(waiting)", "gauge",
                                  [({"state": "running"}, lambda s: s.running),
                                   ({"state": "waiting"}, lambda s: s.waiting)]),
    "kiln_generation_tokens_total": ("Prompt tokens taken in and completion tokens generated", "counter",
                                     [({"kind": "prompt"}, lambda s: s.prompt_tokens_total),
                                      ({"kind": "completion"}, lambda s: s.completion_tokens_total)]),
    "kiln_prefix_cache_queries_total": ("Prompt tokens looked up in the prefix cache", "counter",
                                        [({}, lambda s: s.prefix_cache_queries_total)]),
    "kiln_prefix_cache_hits_total": ("Prompt tokens found in the prefix cache (their keys and values not computed "
                                     "again)", "counter", [({}, lambda s: s.prefix_cache_hits_total)]),
    "kiln_generation_preemptions_total": ("Running sequences preempted for KV-cache blocks (freed, queued again and "
                                          "recomputed)", "counter", [({}, lambda s: s.preemptions_total)]),
}
_HISTOGRAMS: dict[str, tuple[str, Callable[[GenerativeVersion], Histogram]]] = {
    "kiln_time_to_first_token_seconds": ("Seconds from a request's arrival to its first generated token",
                                         lambda v: v.time_to_first_token),
    "kiln_inter_token_latency_seconds": ("Seconds between consecutive tokens of a sequence",
                                         lambda v: v.inter_token_latency),
}


def generation_families(loaded: Iterable[object]) -> Iterable[Metric]:
    """The families of the generative versions among `loaded`; none while no generative model is loaded."""
    versions = [v for v in loaded if isinstance(v, GenerativeVersion)]
    if not versions:
        return
    stats = [(v, v.generator.stats()) for v in versions]
    for name, (help_text, kind, readers) in _FAMILIES.items():
        family = Metric(name, help_text, kind)
        for version, stat in stats:
            for extra, read in readers:
                family.add_sample(name, {**_labels(version), **extra}, float(read(stat)))
        yield family
    for name, (help_text, histogram_of) in _HISTOGRAMS.items():
        family = Metric(name, help_text, "histogram")
        for version in versions:
            add_histogram(family, _labels(version), histogram_of(version))
        yield family


def _labels(version: GenerativeVersion) -> dict[str, str]:
    return {"model": version.name, "version": str(version.version)}

