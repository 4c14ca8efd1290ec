#!/usr/bin/env bash
# wheels_llm/: what `bash bench/device_session.sh llm llm_bench` installs on the GPU machine (no network there), small
# enough to carry with the tree (the carry limit is 64 MiB in all): the server's packages, Jinja for chat templates,
# transformers and what it imports (the exporter and the torch.compile peer), openai for the client tests.
#   bash bench/llm_wheels.sh        then carry [".ab", "wheels_llm"] (or the tree and "wheels_llm")
set -euo pipefail
export WHEELS_DIR=wheels_llm
bash ../shared/tools/device-wheels.sh tritonclient==2.73.0 protobuf==7.36.2 grpcio==1.85.1 grpcio-reflection==1.85.1 \
  orjson httpx httpcore idna certifi urllib3 six opentelemetry-api importlib-metadata \
  jinja2 markupsafe transformers==5.24.0 huggingface_hub tokenizers safetensors regex pyyaml tqdm filelock fsspec \
  packaging typing-extensions typer rich shellingham markdown-it-py mdurl pygments httpx2 httpcore2 truststore \
  openai jiter distro > /dev/null
# not used there: nvmath (Kiln calls cuBLASLt through ctypes), tokenizers (transformers imports without it; the tests
# that compare with it skip), watchfiles (uvicorn's --reload); rapidjson stays (tritonclient.grpc imports it too).
# The tree (~10 MiB) and this folder must stay under the 64 MiB carry together.
rm -f "$WHEELS_DIR"/nvmath_python-*.whl "$WHEELS_DIR"/tokenizers-*.whl "$WHEELS_DIR"/watchfiles-*.whl
du -sh "$WHEELS_DIR"
