"""Free TCP ports on 127.0.0.1 for servers under test (load_tests/harness.py holds the one copy)."""

from load_tests.harness import free_port, free_ports

__all__ = ["free_port", "free_ports"]
