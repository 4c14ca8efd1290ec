"""Restricted APIs, as Triton's `--http-restricted-api` / `--grpc-restricted-api`: a header (HTTP) or metadata
entry (gRPC) with a given value is required for whole API groups.

`--http-restricted-api model-repository,model-config:admin-key=s3cret` means: every request to the repository
or model-configuration endpoints must carry `admin-key: s3cret`; the others stay open. Requests without the
right value get 401 / UNAUTHENTICATED (the value is compared in constant time and never echoed).
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


def unauthenticated(message: str) -> ServerError:
    return ServerError(ErrorKind.UNAUTHENTICATED, message)


@dataclass(frozen=True)
class Restriction:
    """Requests of these groups need header/metadata `key` (lower case) with `value`."""

    groups: frozenset[str]
    key: str
    value: str


@dataclass(frozen=True)
class RestrictedApi:
    """All restrictions of one protocol; empty = everything open."""

    restrictions: tuple[Restriction, ...] = field(default_factory=tuple)

    def __bool__(self) -> bool:
        return bool(self.restrictions)

    def check(self, group: str, headers: Mapping[str, str]) -> None:
        """Raise UNAUTHENTICATED unless `headers` (lower-case keys) carry every credential `group` needs."""
        for restriction in self.restrictions:
            if group not in restriction.groups:
                continue
            given = headers.get(restriction.key)
            if given is None or not hmac.compare_digest(given.encode(), restriction.value.encode()):
                raise unauthenticated(f"this API ({group}) is restricted: the request needs a valid "
                                      f"'{restriction.key}' header (gRPC: metadata entry)")


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


def parse_restricted_api(specs: Iterable[str]) -> RestrictedApi:
    """Restrictions from repeated flags; a group may be restricted once only (as in Triton)."""
    restrictions = [parse_restriction(s) for s in specs]
    seen: set[str] = set()
    for restriction in restrictions:
        twice = seen & restriction.groups
        if twice:
            raise ValueError(f"API group(s) {sorted(twice)} are restricted more than once")
        seen |= restriction.groups
    return RestrictedApi(tuple(restrictions))


def _spec(text: str) -> str:
    try:
        parse_restriction(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_auth_arguments(parser: argparse.ArgumentParser) -> None:
    for protocol in ("http", "grpc"):
        parser.add_argument(f"--{protocol}-restricted-api", action="append", default=[], type=_spec,
                            metavar="GROUPS:KEY=VALUE",
                            help=f"require {'header' if protocol == 'http' else 'metadata'} KEY=VALUE for these "
                                 f"API groups ({', '.join(API_GROUPS)}); repeatable")


def restrictions_from_args(args: argparse.Namespace) -> tuple[RestrictedApi, RestrictedApi]:
    """(HTTP, gRPC) restrictions."""
    return parse_restricted_api(args.http_restricted_api), parse_restricted_api(args.grpc_restricted_api)
