"""Kiln's load-testing tools: `kiln perf` (load_tests/perf.py), a locustfile for mixed traffic, peer servers."""
