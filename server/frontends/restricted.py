"""Triton's answer to a request of a restricted API group that lacks its credential, in each protocol's words.

The check itself is `server.auth.RestrictedApi`; Triton words the refusal differently per protocol
(server/src/http_server.cc RespondIfRestricted: "This API is restricted, expecting header '<key>'";
server/src/grpc/grpc_server.cc: "This protocol is restricted, expecting header '<key>'"), and client code
compares those texts, so each frontend puts Triton's sentence first and Kiln's details after it.
"""

from __future__ import annotations

from server.auth import RestrictedApi, refused
from server.core.errors import ServerError


def restricted_refusal(restricted: RestrictedApi, group: str, error: ServerError, subject: str) -> ServerError:
    """`error` (from `restricted.check`) reworded as Triton's "This <subject> is restricted, ..." sentence, its
    status (HTTP 403, gRPC UNAVAILABLE) kept.

    A group is restricted at most once (`parse_restricted_api` refuses more), so its header is unambiguous."""
    return refused(f"This {subject} is restricted, expecting header '{restricted.header(group)}' ({error.message})")
