"""Type conversion (Cast, CastLike, BitCast) incl. float8/int4/bfloat16."""

from __future__ import annotations
