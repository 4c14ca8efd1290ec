"""Triton's Python backend, the stub side: what runs in the process of a Python model (`backend: "python"`).

`stub.py` is the program of that process: it imports the model's `model.py`, calls `TritonPythonModel`'s
`auto_complete_config`, `initialize`, `execute` and `finalize` when the server asks, and sends BLS requests and log
lines back. `triton_python_backend_utils.py` is the module model.py imports (`import triton_python_backend_utils as
pb_utils`), with Triton's names. `wire.py` frames the messages between the server and a stub.

Nothing here imports Kiln's server or engine: a stub may run in another Python environment (a model's
`EXECUTION_ENV_PATH`), which needs only numpy. The server's side is server/core/python_model.py and python_stub.py.
"""
