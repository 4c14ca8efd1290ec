"""Control flow (If, Loop, Scan): bodies run as subgraphs with access to the enclosing scope."""

from __future__ import annotations
