#!/usr/bin/env bash
# Generative models on the GPU machine, for one `device` call (H100, repo root, results under $OUT).
#
#   bash bench/llm_wheels.sh                      # here, once: wheels_llm/ (~53 MB; carry it instead of wheels/)
#   bash bench/device_llm.sh STAGE [STAGE ...]    # there; carry [".ab", "wheels_llm"] (or the tree + "wheels_llm")
#
# Stages (issue #33's "Done when" lines, in the order to spend device minutes):
#   (MODELS="gpt2" limits check/step/serve to one export; CONCURRENCY and DURATION set the serve stage's load;
#   TESTS="path ..." narrows the tests stage)
#   tests    the @pytest.mark.gpu tests of tests/generate and tests/server/generative (tiny decoder: CUDA greedy
#            tokens against the CPU engine's, batched and chunked prefill, the device KV cache, disconnects)  ~3 min
#   check    exports GPT-2 124M and a Llama-3.2-1B-shaped model (seeded weights; bench/export_decoder.py, with
#            transformers' greedy tokens), then bench/generate_check.py on the CUDA backend in fp16: equal token for
#            token over the first 32                                                                         ~5 min
#   step     bench/generate_step.py: one decode step's time at batch 1/8/64, past 128/512 (needs `check`'s exports
#            in /tmp/llm, so run it in the same call or after `check` on a warm machine; --argmax: greedy too)  ~3 min
#   profile  generate_step --profile --kernels at batch 64, past 128: the layers timed one by one, per kind, and
#            CUPTI's kernel times of graph-replayed steps (their sum against the step's wall time)        ~1 min
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
  tritonclient==2.73.0 python-rapidjson protobuf==7.36.2 grpcio==1.85.1 grpcio-reflection==1.85.1 uvloop httptools orjson \
  httpx httpcore idna certifi urllib3 six opentelemetry-api importlib-metadata jinja2 markupsafe transformers huggingface_hub safetensors regex \
  pyyaml tqdm filelock fsspec packaging typing-extensions typer rich shellingham markdown-it-py mdurl pygments httpx2 \
  httpcore2 truststore openai jiter distro 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader

quiet() { grep -v -e Warning -e "warnings.warn" -e "^  " -e "^$"; }

MODELS=${MODELS:-gpt2 llama}   # which of the two exports a stage uses (MODELS=gpt2 for a shorter call)
SIZE_gpt2=124m SIZE_llama=1b

export_models() {  # GPT-2 124M and a Llama-3.2-1B shape, each with reference.json (transformers' greedy tokens)
  for m in $MODELS; do
    local size=SIZE_$m
    [ -f "$LLM/$m/1/reference.json" ] || timeout 300 python3 bench/export_decoder.py --arch "$m" --size "${!size}" \
      --out "$LLM/$m/1" --check 2>&1 | quiet | tail -2
  done
}

serve_model() {  # kiln serve on one export (KIND_GPU, fp16, 64 sequences), load_tests/generate_bench.py at 1 and 64
  local m=$1 repo=/tmp/llm_repo_$1
  mkdir -p "$repo/$m" && ln -sfn "$LLM/$m/1" "$repo/$m/1"
  printf 'backend: "kiln_llm"\nmax_batch_size: 64\ninstance_group [ { kind: KIND_GPU } ]\n%s\n%s\n' \
    'parameters { key: "max_context" value { string_value: "512" } }' \
    'parameters { key: "kiln_precision" value { string_value: "fp16" } }' > "$repo/$m/config.pbtxt"
  python3 -m server --model-repository "$repo" --http-port 8000 --grpc-port 8001 --metrics-port 8002 \
    > "$OUT/llm_server_$m.log" 2>&1 &
  local server=$! ready=0
  for _ in $(seq 240); do  # a failed load ends the wait at once (it cost a whole call's device time once)
    curl -sf "localhost:8000/v2/models/$m/ready" > /dev/null && { ready=1; break; }
    kill -0 "$server" 2> /dev/null && ! grep -q "failed to load model" "$OUT/llm_server_$m.log" || break
    sleep 1
  done
  if [ $ready = 0 ]; then
    echo "kiln serve $m: not ready"; grep -v "^I" "$OUT/llm_server_$m.log" | tail -5
    kill "$server"; wait "$server" 2> /dev/null; return 1
  fi
  echo "kiln serve $m: $(grep -o "generation loop ready.*" "$OUT/llm_server_$m.log")"
  timeout 150 python3 -m load_tests.generate_bench --url http://127.0.0.1:8000 --model "$m" --api completions \
    --concurrency "${CONCURRENCY:-1,64}" --max-tokens 128 --warmup 3 --duration "${DURATION:-15}" --processes 4 \
    --out "$OUT" 2>&1 | grep -v -e Warning -e "warnings.warn" | tail -4
  curl -s localhost:8002/metrics | grep -E "^kiln_(kv|generation|time_to|inter_token)" | grep -v bucket \
    > "$OUT/llm_metrics_$m.txt"
  kill "$server"; wait "$server" 2> /dev/null
}

for stage in "$@"; do
  echo "== $stage"
  case $stage in
    tests)
      timeout 240 python3 -m pytest -v -m gpu -p no:cacheprovider --timeout 200 -rfE --tb=short \
        ${TESTS:-tests/generate tests/server/generative} 2>&1 | grep -v -e Warning -e "warnings.warn" | grep -E "FAILED|ERROR|passed|failed|^E " \
        | tail -30 | tee "$OUT/llm_gpu_tests.txt" ;;
    check)
      export_models
      timeout 400 python3 bench/generate_check.py $(for m in $MODELS; do echo "$LLM/$m/1"; done) --backend cuda \
        --fp16 --teacher-forced --json "$OUT/generate_check.json" 2>&1 | grep -v -e Warning -e "warnings.warn" \
        | tail -12 ;;
    step)
      export_models
      for m in $MODELS; do
        timeout 200 python3 bench/generate_step.py "$LLM/$m/1" --fp16 --argmax --json "$OUT/generate_step_$m.json" 2>&1 \
          | quiet | tail -12
      done ;;
    profile)
      export_models
      for m in $MODELS; do
        timeout 200 python3 bench/generate_step.py "$LLM/$m/1" --fp16 --batches 1,64 --pasts 128 --iters 10 --profile --kernels \
          --json "$OUT/generate_profile_$m.json" 2>&1 | quiet | tail -70
      done ;;
    serve)
      export_models
      for m in $MODELS; do serve_model "$m"; done
      for m in $MODELS; do
        size=SIZE_$m
        timeout 240 python3 bench/generate_peer.py --arch "$m" --size "${!size}" --batch "${CONCURRENCY:-1,64}" \
          --prompt-tokens 128 --max-tokens 128 --json "$OUT/generate_peer_$m.json" 2>&1 | grep -v -e Warning -e "warnings.warn" | tail -5
      done ;;
    *) echo "unknown stage $stage" ;;
  esac
done
