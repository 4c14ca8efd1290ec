"""Streams against a generative model: output tokens/s, time to first token and inter-token latency.

    python -m load_tests.generate_bench --url http://127.0.0.1:8000 --model gpt2 --concurrency 1,64
    python -m load_tests.generate_bench --tiny --concurrency 1,8 --duration 5     # any machine: starts kiln serve
                                                                                # on examples/generative.py's model

Each stream is a client that sends an OpenAI `/v1/chat/completions` (or `/v1/completions`, `--api completions`)
request with `stream: true` and `stream_options.include_usage`, reads the server-sent events to the end, and sends
the next request at once (closed loop, like perf_analyzer's concurrency mode). Per request it records the time to
the first content chunk (TTFT), the gaps between content chunks (inter-token latency, ITL: a chunk carries one
token's text, or several when a token completes held-back UTF-8 bytes) and the usage's completion tokens.
Output tokens/s is the steady state: the tokens that arrived inside the window (`--duration` after `--warmup`), of
every request, over the window's length (`window_tokens`: each content chunk's arrival, weighted by its request's
completion tokens per chunk). `finished_tokens_per_s` is the older figure: the completion tokens of requests that
started inside the window, over the time until the last of them finished; it includes the ramp-down after the
window (fewer streams each moment) and leaves out the tokens of requests still going at its start, so it reads low
when a request lasts a sizeable part of the window (64 streams of 128 tokens at ~8 ms a token: ~1 s of 10).
TTFT and ITL are those of requests that started inside the window. `--ignore-eos` (Kiln's and vLLM's extension
field) makes every request generate exactly `--max-tokens`, so levels compare like for like.

Client processes (`--processes`) each run an asyncio loop with their share of the streams over httpx, so the
client is not the bottleneck at 64 streams. Results: a table on stdout and `generate_<timestamp>.json` in `--out`
(default bench/results).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from load_tests import harness
from load_tests.stats import percentile

RESULTS = harness.ROOT / "bench" / "results"
PROMPT = ("Write a short story about a kiln that learned to serve models faster than anyone expected, and explain "
          "what made it fast.")


@dataclass
class StreamRecord:
    """One request's timings (monotonic ns) and its completion tokens; `error` is set when it failed."""

    start: int
    first: int = 0
    end: int = 0
    gaps_ns: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    error: str = ""


@dataclass(frozen=True)
class Load:
    url: str
    model: str
    api: str
    max_tokens: int
    ignore_eos: bool
    prompt: str
    streams: int
    warmup_s: float
    duration_s: float


def _body(load: Load) -> dict[str, Any]:
    body: dict[str, Any] = {"model": load.model, "max_tokens": load.max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if load.ignore_eos:
        body["ignore_eos"] = True
    if load.api == "chat":
        body["messages"] = [{"role": "user", "content": load.prompt}]
    else:
        body["prompt"] = load.prompt
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text a streamed chunk carries (chat: delta.content; completions: text)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def _one(client: Any, load: Load, path: str, body: dict[str, Any]) -> StreamRecord:
    record = StreamRecord(start=time.monotonic_ns())
    last = 0
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    record.completion_tokens = int(chunk["usage"].get("completion_tokens", 0))
                if _chunk_text(chunk):
                    now = time.monotonic_ns()
                    if record.first == 0:
                        record.first = now
                    else:
                        record.gaps_ns.append(now - last)
                    last = now
    except Exception as e:  # noqa: BLE001 - a failed request is an error record, never a crash of the client
        record.error = f"{type(e).__name__}: {e}"[:300]
    finally:  # also after an HTTP error's early return: a record without an end is not counted at all
        record.end = time.monotonic_ns()
    return record


async def _streams(load: Load, count: int) -> list[StreamRecord]:
    import httpx

    path = "/v1/chat/completions" if load.api == "chat" else "/v1/completions"
    body = _body(load)
    stop_at = time.monotonic_ns() + int((load.warmup_s + load.duration_s) * 1e9)
    records: list[StreamRecord] = []
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=load.url, timeout=600.0, limits=limits) as client:
        async def stream() -> None:
            while time.monotonic_ns() < stop_at:
                records.append(await _one(client, load, path, body))

        await asyncio.gather(*(stream() for _ in range(count)))
    return records


def _worker(load: Load, count: int, queue: Any) -> None:
    queue.put([asdict(r) for r in asyncio.run(_streams(load, count))])


def run_level(load: Load, processes: int) -> dict[str, Any]:
    """`load.streams` closed-loop streams split over client processes; the level's summary."""
    processes = max(1, min(processes, load.streams))
    shares = [load.streams // processes + (i < load.streams % processes) for i in range(processes)]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    started = time.monotonic_ns()
    workers = [context.Process(target=_worker, args=(load, share, queue)) for share in shares]
    for worker in workers:
        worker.start()
    records = [StreamRecord(**r) for _ in workers for r in queue.get()]
    for worker in workers:
        worker.join()
    return summarize(records, started + int(load.warmup_s * 1e9), load)


def window_tokens(record: StreamRecord, start_ns: int, end_ns: int) -> float:
    """The completion tokens of ``record`` that arrived in [start_ns, end_ns): its content chunks there, each
    weighted by the request's tokens per chunk (a chunk is one token unless held-back UTF-8 bytes joined two)."""
    if record.error or not record.first:
        return 0.0
    arrivals, at = [record.first], record.first
    for gap in record.gaps_ns:
        at += gap
        arrivals.append(at)
    inside = sum(start_ns <= t < end_ns for t in arrivals)
    return inside * (record.completion_tokens or len(arrivals)) / len(arrivals)


def summarize(records: list[StreamRecord], window_start: int, load: Load) -> dict[str, Any]:
    """Tokens/s in the window (the module docstring), and of the requests that started in it and finished: their
    count, errors, tokens/s until the last finished, TTFT and ITL."""
    counted = [r for r in records if r.start >= window_start and r.end]
    good = [r for r in counted if not r.error]
    errors = [r.error for r in counted if r.error]
    span_s = (max((r.end for r in counted), default=window_start) - window_start) / 1e9 or float("nan")
    tokens = sum(r.completion_tokens for r in good)
    window_end = window_start + int(load.duration_s * 1e9)
    in_window = sum(window_tokens(r, window_start, window_end) for r in records)
    ttft_ms = [(r.first - r.start) / 1e6 for r in good if r.first]
    itl_ms = [g / 1e6 for r in good for g in r.gaps_ns]
    return {"streams": load.streams, "requests": len(good), "errors": len(errors), "first_error": errors[0] if errors else "",
            "output_tokens": tokens, "window_s": span_s, "finished_tokens_per_s": tokens / span_s,
            "window_tokens": in_window, "output_tokens_per_s": in_window / load.duration_s,
            "tokens_per_request": statistics.mean([r.completion_tokens for r in good]) if good else 0.0,
            "ttft_ms": {f"p{q}": percentile(ttft_ms, q) for q in (50, 90, 99)},
            "itl_ms": {f"p{q}": percentile(itl_ms, q) for q in (50, 90, 99)}}


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'streams':>8} {'requests':>9} {'tok/s':>10} {'finished':>9} {'tok/req':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8} {'errors':>7}")
    for row in rows:
        print(f"{row['streams']:>8} {row['requests']:>9} {row['output_tokens_per_s']:>10.1f} "
              f"{row['finished_tokens_per_s']:>9.1f} "
              f"{row['tokens_per_request']:>8.1f} {row['ttft_ms']['p50']:>9.2f} {row['ttft_ms']['p99']:>9.2f} "
              f"{row['itl_ms']['p50']:>8.2f} {row['itl_ms']['p99']:>8.2f} {row['errors']:>7}")


def _tiny_repository(directory: Path, max_batch: int) -> Path:
    """A model repository with examples/generative.py's tiny decoder as `tiny_gpt` (backend kiln_llm, CPU)."""
    model = directory / "tiny_gpt"
    harness.load_example("generative.py").write_tiny_decoder(model / "1")
    (model / "config.pbtxt").write_text(f'backend: "kiln_llm"\nmax_batch_size: {max_batch}\n'
                                        'instance_group [ { kind: KIND_CPU } ]\n'
                                        'parameters { key: "max_context" value { string_value: "256" } }\n')
    return directory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="tiny_gpt")
    p.add_argument("--api", choices=["chat", "completions"], default="chat")
    p.add_argument("--concurrency", default="1,64", help="comma-separated stream counts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before the window")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of the measured window")
    p.add_argument("--processes", type=int, default=2, help="client processes")
    p.add_argument("--tiny", action="store_true", help="start kiln serve on the tiny example decoder (CPU)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    rows: list[dict[str, Any]] = []

    def measure(url: str) -> None:
        for streams in levels:
            load = Load(url, args.model, args.api, args.max_tokens, args.ignore_eos, args.prompt, streams,
                        args.warmup, args.duration)
            rows.append(run_level(load, args.processes))

    if args.tiny:
        with tempfile.TemporaryDirectory() as tmp:
            repository = _tiny_repository(Path(tmp) / "models", max(levels))
            ports = harness.free_ports(3)
            log = Path(tmp) / "kiln.log"
            url = f"http://127.0.0.1:{ports[0]}"
            with harness.serving(harness.kiln_command(repository, ports), log,
                                 harness.http_ready(f"{url}/v2/health/ready"), timeout_s=300):
                measure(url)
    else:
        measure(args.url)
    print_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"generate_{time.strftime('%Y%m%dT%H%M%S')}.json"
    document = {"model": args.model, "api": args.api, "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
                "warmup_s": args.warmup, "duration_s": args.duration, "levels": rows}
    path.write_text(json.dumps(document, indent=2))
    print(f"wrote {path}")
    return 0 if all(row["errors"] == 0 for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
