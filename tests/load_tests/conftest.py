"""Reuse the server tests' real server subprocess (tests/server/conftest.py) for the load-test tool's tests."""

from tests.server.conftest import kiln_server  # noqa: F401  (a pytest fixture, used by name)
