"""What the tests share: free ports (ports.py) and real server processes (servers.py).

Both sit on load_tests/harness.py (which ships with the package, so load tests and benchmarks use it too);
load_tests never imports tests.
"""
