"""Server tests: a real server process driven by stock clients."""
