"""Restricted APIs, as Triton's `--http-restricted-api` / `--grpc-restricted-protocol`: a header (HTTP) or metadata
entry (gRPC) with a given value is required for whole API groups.

`--http-restricted-api model-repository,model-config:admin-key=s3cret` means: every request to the repository
or model-configuration endpoints must carry `admin-key: s3cret`; the others stay open. Over gRPC the metadata
entry is `triton-grpc-protocol-admin-key`, as Triton names it. Requests without the right value get what Triton
answers (measured against tritonserver 2.51): HTTP 403, gRPC UNAVAILABLE (the value is compared in constant time and
never echoed). `--grpc-restricted-api` is accepted as another name for the gRPC flag.
"""

from __future__ import annotations

import argparse
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from server.core.errors import ErrorKind, ServerError

API_GROUPS = ("health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
              "statistics", "trace", "logging")

# HTTP routes by API group; the first pattern that matches the path wins.
_HTTP_GROUPS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^/v2/health/"), "health"),
    (re.compile(r"^/v2/repository/"), "model-repository"),
    (re.compile(r"^/v2/(system|cuda)sharedmemory(/|$)"), "shared-memory"),
    (re.compile(r"^/v2/logging/?$"), "logging"),
    (re.compile(r"/trace/setting/?$"), "trace"),
    (re.compile(r"^/v2/models/[^/]+(/versions/[^/]+)?/ready/?$"), "health"),
    (re.compile(r"^/v2/models/[^/]+(/versions/[^/]+)?/infer/?$"), "inference"),
    (re.compile(r"^/v2/models/[^/]+(/versions/[^/]+)?/config/?$"), "model-config"),
    (re.compile(r"(^/v2/models/stats|/stats)/?$"), "statistics"),
]

# gRPC methods (the last part of "/inference.GRPCInferenceService/ModelInfer") by API group.
_GRPC_GROUPS: dict[str, str] = {
    "ServerLive": "health", "ServerReady": "health", "ModelReady": "health", "Check": "health", "Watch": "health",
    "ServerMetadata": "metadata", "ModelMetadata": "metadata",
    "ModelInfer": "inference", "ModelStreamInfer": "inference",
    "ModelConfig": "model-config", "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository", "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "SystemSharedMemoryStatus": "shared-memory", "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory", "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory", "CudaSharedMemoryUnregister": "shared-memory",
    "TraceSetting": "trace", "LogSettings": "logging",
}


def http_group(path: str) -> str:
    """The API group of an HTTP path; everything else (server and model metadata, /docs) is "metadata"."""
    for pattern, group in _HTTP_GROUPS:
        if pattern.search(path):
            return group
    return "metadata"


def grpc_group(method: str) -> str:
    """The API group of a full gRPC method name; reflection and unknown methods are "metadata"."""
    return _GRPC_GROUPS.get(method.rsplit("/", 1)[-1], "metadata")


#: what Triton's gRPC server expects before the configured key (grpc_server.cc: "triton-grpc-protocol-" + key)
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"


def refused(message: str) -> ServerError:
    """A request without its group's credential: Triton answers HTTP 403 and gRPC UNAVAILABLE."""
    error = ServerError(ErrorKind.UNAVAILABLE, message)
    error.http_status = 403  # type: ignore[attr-defined]
    return error


@dataclass(frozen=True)
class Restriction:
    """Requests of these groups need header/metadata `key` (lower case) with `value`."""

    groups: frozenset[str]
    key: str
    value: str


@dataclass(frozen=True)
class RestrictedApi:
    """All restrictions of one protocol; empty = everything open. `header_prefix` goes before each key in the
    header or metadata name the request must carry (gRPC: GRPC_HEADER_PREFIX)."""

    restrictions: tuple[Restriction, ...] = field(default_factory=tuple)
    header_prefix: str = ""

    def __bool__(self) -> bool:
        return bool(self.restrictions)

    def header(self, group: str) -> str:
        """The header (metadata) name `group`'s credential travels in ('' when the group is open)."""
        key = next((r.key for r in self.restrictions if group in r.groups), "")
        return self.header_prefix + key if key else ""

    def check(self, group: str, headers: Mapping[str, str]) -> None:
        """Raise `refused` unless `headers` (lower-case keys) carry every credential `group` needs."""
        for restriction in self.restrictions:
            if group not in restriction.groups:
                continue
            given = headers.get(self.header_prefix + restriction.key)
            if given is None or not hmac.compare_digest(given.encode(), restriction.value.encode()):
                raise refused(f"this API group ({group}) needs a valid '{self.header_prefix + restriction.key}' "
                              f"{'metadata entry' if self.header_prefix else 'header'}")


def parse_restriction(spec: str) -> Restriction:
    """`group[,group...]:key=value`, as Triton writes it."""
    groups_text, sep, credential = spec.partition(":")
    key, eq, value = credential.partition("=")
    if not sep or not eq or not key.strip() or not value:
        raise ValueError(f"restricted API '{spec}' must look like 'model-repository,model-config:key=value'")
    groups = frozenset(g.strip() for g in groups_text.split(",") if g.strip())
    unknown = sorted(groups - set(API_GROUPS))
    if not groups or unknown:
        raise ValueError(f"restricted API '{spec}': unknown group(s) {unknown or ['(none)']}; "
                         f"groups are {', '.join(API_GROUPS)}")
    return Restriction(groups, key.strip().lower(), value)


def parse_restricted_api(specs: Iterable[str], header_prefix: str = "") -> RestrictedApi:
    """Restrictions from repeated flags; a group may be restricted once only (as in Triton)."""
    restrictions = [parse_restriction(s) for s in specs]
    seen: set[str] = set()
    for restriction in restrictions:
        twice = seen & restriction.groups
        if twice:
            raise ValueError(f"API group(s) {sorted(twice)} are restricted more than once")
        seen |= restriction.groups
    return RestrictedApi(tuple(restrictions), header_prefix)


def _spec(text: str) -> str:
    try:
        parse_restriction(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_auth_arguments(parser: argparse.ArgumentParser) -> None:
    groups = ", ".join(API_GROUPS)
    parser.add_argument("--http-restricted-api", action="append", default=[], type=_spec, metavar="GROUPS:KEY=VALUE",
                        help=f"require header KEY: VALUE for these API groups ({groups}); repeatable")
    parser.add_argument("--grpc-restricted-protocol", "--grpc-restricted-api", dest="grpc_restricted_api",
                        action="append", default=[], type=_spec, metavar="GROUPS:KEY=VALUE",
                        help=f"require metadata triton-grpc-protocol-KEY: VALUE for these API groups ({groups}); "
                             f"repeatable (Triton's flag; --grpc-restricted-api is another name for it)")


def restrictions_from_args(args: argparse.Namespace) -> tuple[RestrictedApi, RestrictedApi]:
    """(HTTP, gRPC) restrictions."""
    return (parse_restricted_api(args.http_restricted_api),
            parse_restricted_api(args.grpc_restricted_api, GRPC_HEADER_PREFIX))
