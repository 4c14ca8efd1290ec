"""Dependencies shared by the routers: the core the app serves, and JSON bodies parsed by their schema.

Bodies are parsed here instead of by FastAPI's body parameters because tritonclient sends JSON without a
Content-Type header (FastAPI would then not parse it) and sometimes an empty body where the schema has
defaults; every way a body can be wrong ends as one 400 with `{"error": ...}`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from pydantic import TypeAdapter, ValidationError

from server.core import ServerCore
from server.core.errors import invalid

T = TypeVar("T")


async def get_core(request: Request) -> ServerCore:
    """Async on purpose: FastAPI runs a plain `def` dependency in a worker thread, a thread hop per request."""
    return request.app.state.core


CoreDep = Annotated[ServerCore, Depends(get_core)]


def describe_validation(error: ValidationError) -> str:
    parts = []
    for problem in error.errors():
        where = ".".join(str(p) for p in problem.get("loc", ()))
        parts.append(f"{where}: {problem['msg']}" if where else problem["msg"])
    return "; ".join(parts)


def json_body(schema: Any, required: bool = True) -> Any:
    """A dependency that parses the request body as JSON into `schema` (None if empty and not required)."""
    adapter = TypeAdapter(schema)

    async def parse(request: Request) -> Any:
        raw = await request.body()
        request.app.state.limits.check_json_size(len(raw))  # --http-max-input-size, as Triton bounds every JSON
        if not raw.strip():
            if required:
                raise invalid("the request needs a JSON body")
            return None
        try:
            document = json.loads(raw)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, too-long ints, too-deep nesting
            raise invalid(f"failed to parse the request JSON: {str(e)[:200]}") from None
        try:
            return adapter.validate_python(document)
        except ValidationError as e:
            raise invalid(f"invalid request: {describe_validation(e)}") from None

    return Depends(parse)


def body_doc(schema: Any) -> dict[str, Any]:
    """`openapi_extra` that documents a body parsed by `json_body`."""
    return {"requestBody": {"content": {"application/json": {"schema": TypeAdapter(schema).json_schema()}}}}
