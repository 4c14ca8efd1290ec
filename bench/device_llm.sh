#!/usr/bin/env bash
# Generative models on the GPU machine, for one `device` call (H100, repo root, results under $OUT).
#
#   bash bench/llm_wheels.sh                      # here, once: wheels_llm/ (~53 MB; carry it instead of wheels/)
#   bash bench/device_llm.sh STAGE [STAGE ...]    # there; carry [".ab", "wheels_llm"] (or the tree + "wheels_llm")
#
# Stages (issue #33's "Done when" lines, in the order to spend device minutes):
#   tests    the @pytest.mark.gpu tests of tests/generate and tests/server/generative (tiny decoder: CUDA greedy
#            tokens against the CPU engine's, batched and chunked prefill, the device KV cache, disconnects)  ~3 min
#   check    exports GPT-2 124M and a Llama-3.2-1B-shaped model (seeded weights; bench/export_decoder.py, with
#            transformers' greedy tokens), then bench/generate_check.py on the CUDA backend in fp16: equal token for
#            token over the first 32                                                                         ~5 min
#   step     bench/generate_step.py: one decode step's time at batch 1/8/64, past 128/512 (needs `check`'s exports
#            in /tmp/llm, so run it in the same call or after `check` on a warm machine)                      ~2 min
#   serve    kiln serve on the GPT-2 export (KIND_GPU, fp16, 64 sequences) and load_tests/generate_bench.py at
#            1 and 64 streams, then bench/generate_peer.py (transformers + torch.compile reduce-overhead, static cache)
#            at batch 1 and 64 on the same model: tokens/s, TTFT, ITL side by side                            ~6 min
set -o pipefail
export PYTHONPATH=$PWD KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kc} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
LLM=${LLM_DIR:-/tmp/llm}
mkdir -p "$OUT" "$LLM"
python3 -m pip install -q --no-index --no-deps --find-links wheels_llm nvidia-cudnn-frontend fastapi starlette \
  pydantic pydantic-core typing-inspection annotated-types uvicorn h11 click anyio sniffio prometheus-client \
  tritonclient==2.73.0 protobuf==7.36.2 grpcio==1.85.1 grpcio-reflection==1.85.1 watchfiles uvloop httptools orjson \
  httpx httpcore idna certifi urllib3 six jinja2 markupsafe transformers huggingface_hub tokenizers safetensors regex \
  pyyaml tqdm filelock fsspec packaging typing-extensions typer rich shellingham markdown-it-py mdurl pygments httpx2 \
  httpcore2 truststore openai jiter distro 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader

quiet() { grep -v -e Warning -e "warnings.warn" -e "^  " -e "^$"; }

export_models() {  # GPT-2 124M and a Llama-3.2-1B shape, each with reference.json (transformers' greedy tokens)
  [ -f "$LLM/gpt2/1/reference.json" ] || timeout 240 python3 bench/export_decoder.py --arch gpt2 --size 124m \
    --out "$LLM/gpt2/1" --check 2>&1 | quiet | tail -2
  [ -f "$LLM/llama/1/reference.json" ] || timeout 300 python3 bench/export_decoder.py --arch llama --size 1b \
    --out "$LLM/llama/1" --check 2>&1 | quiet | tail -2
}

for stage in "$@"; do
  echo "== $stage"
  case $stage in
    tests)
      timeout 240 python3 -m pytest -v -m gpu -p no:cacheprovider --timeout 200 -rf tests/generate \
        tests/server/generative 2>&1 | quiet | grep -E "FAILED|ERROR|passed|failed" | tail -30 \
        | tee "$OUT/llm_gpu_tests.txt" ;;
    check)
      export_models
      timeout 300 python3 bench/generate_check.py "$LLM/gpt2/1" "$LLM/llama/1" --backend cuda --fp16 \
        --json "$OUT/generate_check.json" 2>&1 | quiet | tail -6 ;;
    step)
      export_models
      timeout 200 python3 bench/generate_step.py "$LLM/gpt2/1" "$LLM/llama/1" --json "$OUT/generate_step.json" \
        2>&1 | quiet | tail -20 ;;
    serve)
      export_models
      repo=/tmp/llm_repo && mkdir -p "$repo/gpt2" && ln -sfn "$LLM/gpt2/1" "$repo/gpt2/1"
      printf 'backend: "kiln_llm"\nmax_batch_size: 64\ninstance_group [ { kind: KIND_GPU } ]\n%s\n%s\n' \
        'parameters { key: "max_context" value { string_value: "512" } }' \
        'parameters { key: "kiln_precision" value { string_value: "fp16" } }' > "$repo/gpt2/config.pbtxt"
      python3 -m server --model-repository "$repo" --http-port 8000 --grpc-port 8001 --metrics-port 8002 \
        > "$OUT/llm_server.log" 2>&1 &
      server=$!
      for _ in $(seq 240); do curl -sf localhost:8000/v2/health/ready > /dev/null && break; sleep 1; done
      timeout 150 python3 -m load_tests.generate_bench --url http://127.0.0.1:8000 --model gpt2 --api completions \
        --concurrency 1,64 --max-tokens 128 --warmup 3 --duration 15 --processes 4 --out "$OUT" 2>&1 | quiet | tail -5
      curl -s localhost:8002/metrics | grep -E "^kiln_(kv|generation|time_to|inter_token)" | grep -v bucket \
        > "$OUT/llm_metrics.txt"
      kill "$server"; wait "$server" 2> /dev/null
      timeout 240 python3 bench/generate_peer.py --arch gpt2 --size 124m --batch 1,64 --prompt-tokens 128 \
        --max-tokens 128 --json "$OUT/generate_peer.json" 2>&1 | quiet | tail -5 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
