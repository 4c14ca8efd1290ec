"""tritonserver's flags that `kiln serve` has no flag of its own for: each is honoured, or accepted only at the value
that is what Kiln does anyway, or refused before anything starts with a message naming the flag and what to do.

Why: a deployment moved from Triton keeps its command line. A flag Kiln took and ignored would change behaviour
silently; one argparse does not know ends the start with "unrecognized arguments", naming neither the reason nor the
way out. The list is tritonserver 2.x's `--help`; flags Kiln implements itself (`--model-repository`, the TLS,
metrics, trace and logging flags, ...) are defined where they are implemented.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from server.flags import parse_bool


@dataclass(frozen=True)
class TritonFlag:
    """A tritonserver flag Kiln does not implement: the values it accepts (what Kiln does anyway, compared after
    `normal`) and what to do instead."""

    name: str
    accepted: tuple[str, ...]
    advice: str
    boolean: bool = False
    switch: bool = False  # takes no value (given or not)

    def normal(self, value: str) -> str:
        return str(parse_bool(value)).lower() if self.boolean else value.strip().lower()


_HTTP2 = ("Kiln's HTTP/2 layer answers every ping and keeps a connection until its client closes it; remove the "
          "flag")
_SIZING = "Kiln sizes this itself (device memory per plan, host buffers per binding); remove the flag"

#: every tritonserver flag without a Kiln flag of the same name, by name
REFUSED: dict[str, TritonFlag] = {flag.name: flag for flag in (
    TritonFlag("--disable-auto-complete-config", (), "Kiln completes a config from its model as Triton does by "
               "default; a complete config.pbtxt is used as written", switch=True),
    TritonFlag("--strict-model-config", ("false",), "Kiln completes a config from its model (Triton's default, "
               "--strict-model-config=false); write the config in full instead", boolean=True),
    TritonFlag("--model-load-retry-count", ("0",), "Kiln loads a model once; load it again through the "
               "repository API (POST /v2/repository/models/<m>/load)"),
    TritonFlag("--model-namespacing", ("false",), "model names are one namespace across repositories in Kiln",
               boolean=True),
    TritonFlag("--enable-peer-access", ("true",), "Kiln always opens CUDA shared memory of another GPU by peer "
               "access", boolean=True),
    TritonFlag("--reuse-http-port", ("false",), "Kiln's frontend processes share the port among themselves; run "
               "one server per port", boolean=True),
    TritonFlag("--reuse-grpc-port", ("false",), "run one Kiln server per port", boolean=True),
    TritonFlag("--http-header-forward-pattern", (), "Kiln does not forward HTTP headers to models as request "
               "parameters; send them as parameters in the request body"),
    TritonFlag("--grpc-header-forward-pattern", (), "Kiln does not forward gRPC metadata to models as request "
               "parameters; send them as InferParameter entries"),
    TritonFlag("--http-thread-count", (), "Kiln serves HTTP from --frontend-processes N processes (default auto); "
               "use that flag instead"),
    TritonFlag("--grpc-infer-allocation-pool-size", (), _SIZING),
    TritonFlag("--grpc-infer-response-compression-level", ("none",), "Kiln compresses a gRPC response only when "
               "its client asks (grpc-accept-encoding)"),
    TritonFlag("--grpc-keepalive-time", (), _HTTP2),
    TritonFlag("--grpc-keepalive-timeout", (), _HTTP2),
    TritonFlag("--grpc-keepalive-permit-without-calls", (), _HTTP2, boolean=True),
    TritonFlag("--grpc-http2-max-pings-without-data", (), _HTTP2),
    TritonFlag("--grpc-http2-min-recv-ping-interval-without-data", (), _HTTP2),
    TritonFlag("--grpc-http2-max-ping-strikes", (), _HTTP2),
    TritonFlag("--grpc-max-connection-age", (), _HTTP2),
    TritonFlag("--grpc-max-connection-age-grace", (), _HTTP2),
    TritonFlag("--allow-sagemaker", ("false",), "Kiln has no SageMaker endpoint", boolean=True),
    TritonFlag("--sagemaker-port", (), "Kiln has no SageMaker endpoint"),
    TritonFlag("--sagemaker-safe-port-range", (), "Kiln has no SageMaker endpoint"),
    TritonFlag("--sagemaker-thread-count", (), "Kiln has no SageMaker endpoint"),
    TritonFlag("--allow-vertex-ai", ("false",), "Kiln has no Vertex AI endpoint", boolean=True),
    TritonFlag("--vertex-ai-port", (), "Kiln has no Vertex AI endpoint"),
    TritonFlag("--vertex-ai-thread-count", (), "Kiln has no Vertex AI endpoint"),
    TritonFlag("--vertex-ai-default-model", (), "Kiln has no Vertex AI endpoint"),
    TritonFlag("--backend-directory", (), "Kiln's backends are built in (ONNX models, Python models, kiln_llm); "
               "remove the flag"),
    TritonFlag("--backend-config", (), "Kiln's backends take their settings from each model's config.pbtxt "
               "parameters; remove the flag"),
    TritonFlag("--repoagent-directory", (), "Kiln's repository agents are built in (the checksum agent); other "
               "agents cannot be loaded from a directory, remove the flag"),
    TritonFlag("--cache-directory", (), "Kiln's response cache is built in (--cache-config local,size=N)"),
    TritonFlag("--rate-limit", ("off",), "Kiln has no rate limiter; bound concurrency with instance_group counts "
               "and the batcher's queue policy"),
    TritonFlag("--rate-limit-resource", (), "Kiln has no rate limiter"),
    TritonFlag("--pinned-memory-pool-byte-size", (), _SIZING),
    TritonFlag("--cuda-memory-pool-byte-size", (), _SIZING),
    TritonFlag("--cuda-virtual-address-size", (), _SIZING),
    TritonFlag("--min-supported-compute-capability", (), "Kiln's CUDA plans name the architectures they run on "
               "(`kiln inspect`); choose the GPUs with --gpus"),
    TritonFlag("--buffer-manager-thread-count", (), _SIZING),
    TritonFlag("--host-policy", (), "Kiln has no host policies; pin the server with taskset or a container's "
               "cpuset"),
    TritonFlag("--model-load-gpu-limit", (), "Kiln refuses a plan that does not fit the device's free memory when "
               "it loads; there is no fraction limit"),
)}


def add_triton_flags(parser: argparse.ArgumentParser) -> None:
    """The refused flags, parsed (one value each, or none for a switch) so that `check_triton_flags` can name them;
    hidden from --help."""
    for flag in REFUSED.values():
        if flag.switch:
            parser.add_argument(flag.name, action="store_const", const="", default=None, help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag.name, default=None, metavar="VALUE", help=argparse.SUPPRESS)


def check_triton_flags(args: argparse.Namespace) -> None:
    """ValueError naming the first refused flag given (at a value Kiln does not behave as), and what to do."""
    for flag in REFUSED.values():
        value = getattr(args, flag.name[2:].replace("-", "_"))
        if value is None:
            continue
        try:
            accepted = flag.normal(value) in flag.accepted
        except argparse.ArgumentTypeError:
            accepted = False
        if not accepted:
            given = flag.name if value == "" else f"{flag.name}={value}"
            allowed = f" (accepted: {', '.join(flag.accepted)})" if flag.accepted else ""
            raise ValueError(f"{given}: Kiln does not implement this Triton flag{allowed}: {flag.advice}")
