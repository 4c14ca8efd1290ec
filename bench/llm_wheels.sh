#!/usr/bin/env bash
# wheels_llm/: what `bash bench/device_session.sh llm llm_bench` installs on the GPU machine (no network there), small
# enough to carry with the tree (the carry limit is 64 MiB in all): the server's packages, Jinja for chat templates,
# transformers and what it imports (the exporter and the torch.compile peer), openai for the client tests.
#   bash bench/llm_wheels.sh        then carry [".ab", "wheels_llm"] (or the tree and "wheels_llm")
set -euo pipefail
export WHEELS_DIR=wheels_llm
bash ../shared/tools/device-wheels.sh tritonclient==2.73.0 protobuf==7.36.2 grpcio==1.85.1 grpcio-reflection==1.85.1 \
  orjson httpx httpcore idna certifi urllib3 six \
  jinja2 markupsafe transformers==5.24.0 huggingface_hub tokenizers safetensors regex pyyaml tqdm filelock fsspec \
  packaging typing-extensions typer rich shellingham markdown-it-py mdurl pygments httpx2 httpcore2 truststore \
  openai jiter distro > /dev/null
# not used there: nvmath (Kiln calls cuBLASLt through ctypes), rapidjson (tritonclient's HTTP client, which the llm
# stages do not use: no gevent stack either)
rm -f "$WHEELS_DIR"/nvmath_python-*.whl "$WHEELS_DIR"/python_rapidjson-*.whl
du -sh "$WHEELS_DIR"
