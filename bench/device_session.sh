#!/usr/bin/env bash
# GPU checks and benchmarks for one `device` call (H100 machine, repo root, results under $OUT).
#
#   bash bench/device_session.sh STAGE [STAGE ...]     (carry ["wheels"]; wheels/ from ../shared/tools/device-wheels.sh)
#   (WHEELS=dir: another wheel folder, e.g. a subset of wheels/ without transformers that fits the 64 MiB carry)
#
# Stages, in the order a session should spend its 30 device minutes (each stage is time-boxed):
#   tests        tests/cuda's @pytest.mark.gpu tests but the model ones (CUDA backend, fused layers, flash attention,
#                INT8 GEMM and convolution, runner, serving I/O; ~6 min on a cold machine)                 ~6 min
#   tests2       tests/engine's GPU tests, CUDA/system shared memory and executor processes through real servers
#                (give `tests` and `tests2` separate calls on a cold machine)                              ~4 min
#   models       tests/cuda/test_models_gpu.py: every tools/make_models.py model at fp32/TF32/FP16 vs the CPU
#                backend (split from tests in session 6; ~5.5 min on a cold kernel cache, session 10)     ~6 min
#   pointwise    bench.pointwise: generated kernels at BERT-base sizes vs a same-size copy and torch eager    ~1 min
#   pool         bench.global_pool: channels-last global pooling's band kernel vs the per-output kernel it replaced  ~1 min
#   norm         bench.norm: residual-add + LayerNorm (and its int8-quantizing form) vs torch eager and a copy  ~1 min
#   attention    the flash attention GPU tests, then bench.attention: fused attention (and attention -> int8) at
#                BERT-base sizes, seq 512 and causal head size 128 vs torch scaled_dot_product_attention   ~2 min
#   qgemm        the sm_90 INT8 GEMM's GPU tests, then bench.qgemm: BERT-base linear layers in INT8 (Kiln's
#                kernel, cuBLASLt + epilogue kernel) vs fp16 (Kiln, torch) and torch._int_mm                ~3 min
#   bert         bench.engine BERT-base tf32+fp16 at batch 1, 8, 64 vs torch eager + compile reduce-overhead  ~4 min
#   resnet       bench.engine ResNet-50 tf32+fp16 at batch 1, 8, 32, 128, same peers                          ~5 min
#   strict       bench.engine ResNet-50 strict fp32 against TF32 at batch 128, torch eager beside it (#34's line: strict
#                fp32 <= 3x TF32; 4.1x on an H100, torch with cudnn.benchmark 5.3x)                          ~3 min
#   autotune     torch.compile max-autotune-no-cudagraphs peer, tf32: BERT 8, ResNet 128 and 8 (compiles ~2 min each) ~9 min
#   int8         bench.int8 (ResNet-50 / BERT-base INT8 vs Kiln fp16) and bench.accuracy (1,000 images)       ~9 min
#   cudnn_int8   bench.cudnn_int8: every ResNet-50 convolution as one requantizing INT8 cuDNN graph vs fp16          ~2 min
#   zoo          bench.zoo: every zoo model (ResNet-50 ... Llama-style, YOLO + NMS) fp16 at batch 1 and its throughput
#                batch vs torch eager and compile reduce-overhead (peers precompiled in 12 processes); ZOO_MODELS
#                picks a subset                                                                              ~9 min
#   conformance  48 shards of `kiln conformance --backend cuda`, merged into $OUT/conformance_cuda.md          ~2 min
#   serving_ab   #29: gpu_serving BERT gRPC and ResNet-50 gRPC+HTTP c=64 with KILN_EXECUTOR_IO thread / loop, two
#                alternating rounds, then BERT with --preferred-batch-sizes 16,32; $OUT/serving_ab.json        ~8 min
#   faults       load_tests/gpu_faults.py (#35): oversize load, sticky CUDA error, executor SIGKILL, unload/reload
#                and 20 load/unload cycles for device memory, each under c=64 HTTP+gRPC traffic on ResNet-50 fp16;
#                $OUT/faults_gpu_*.json and its server log (in a call of its own: the first build takes minutes) ~9 min
# The machine has no network: everything Kiln needs beyond the image comes from wheels/.
# Same-call A/B against an earlier commit (machines differ by ~30%, so only same-call ratios count):
#   rm -rf .ab/base && mkdir -p .ab/base && git archive REV | tar -x -C .ab/base     (.ab/ is git-ignored)
#   carry [".ab", "wheels"]; run the baseline as (cd .ab/base && PYTHONPATH=$PWD python3 load_tests/gpu_serving.py ...)
set -o pipefail
export PYTHONPATH=$PWD KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kc} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --find-links "${WHEELS:-wheels}" nvidia-cudnn-frontend fastapi starlette pydantic \
  pydantic-core typing-inspection annotated-types uvicorn h11 click anyio sniffio python-rapidjson prometheus-client \
  tritonclient==2.73.0 httpx httpcore idna certifi gevent geventhttpclient greenlet zope.event zope.interface brotli \
  urllib3 six protobuf==7.36.2 grpcio==1.85.1 grpcio-reflection==1.85.1 watchfiles opentelemetry-api \
  importlib-metadata uvloop httptools orjson 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader

quiet() { grep -v -e Warning -e "warnings.warn" -e "^  " -e "^$"; }

for stage in "$@"; do
  echo "== $stage"
  case $stage in
    tests)  # tests/cuda's GPU tests but the model ones; -v names a failure as it happens (a timeout keeps those lines)
      timeout 400 python3 -m pytest -v -m gpu -p no:cacheprovider --timeout 200 -rf tests/cuda \
        --ignore tests/cuda/test_models_gpu.py 2>&1 | quiet | grep -E "FAILED|ERROR|passed|failed" | tail -40 \
        | tee "$OUT/gpu_tests.txt" ;;
    tests2)  # tests/engine's GPU tests and the server's GPU paths
      timeout 240 python3 -m pytest -v -m gpu -p no:cacheprovider --timeout 200 -rf tests/engine \
        tests/server/test_cuda_shared_memory.py tests/server/test_system_shm_gpu.py \
        2>&1 | quiet | grep -E "FAILED|ERROR|passed|failed" | tail -40 | tee "$OUT/gpu_tests2.txt"
      # not gpu-marked (they run CPU executors in CI); here KIND_AUTO makes their served models CUDA ones
      timeout 90 python3 -m pytest -v -p no:cacheprovider --timeout 60 -rf tests/server/test_executor_process.py \
        2>&1 | quiet | grep -E "FAILED|ERROR|passed|failed" | tail -20 | tee -a "$OUT/gpu_tests2.txt" ;;
    models)
      timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 300 -rf tests/cuda/test_models_gpu.py \
        2>&1 | quiet | tail -40 | tee "$OUT/gpu_model_tests.txt" ;;
    pointwise)
      timeout 150 python3 -m bench.pointwise --out "$OUT" 2>&1 | quiet | tail -8 ;;
    pool)
      timeout 120 python3 -m bench.global_pool --out "$OUT" 2>&1 | quiet | tail -7 ;;
    norm)
      timeout 150 python3 -m bench.norm --out "$OUT" 2>&1 | quiet | tail -4 ;;
    attention)
      timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 200 -rf tests/cuda/test_backend_gpu.py \
        tests/engine/test_fuse_attention_quantize.py -k "attention" 2>&1 | quiet | tail -25 | tee "$OUT/gpu_attention_tests.txt"
      timeout 200 python3 -m bench.attention --out "$OUT" 2>&1 | quiet | tail -8 ;;
    qgemm)
      timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 200 -rf tests/cuda/test_qgemm.py \
        tests/cuda/test_int8_gemm.py 2>&1 | quiet | tail -25 | tee "$OUT/gpu_qgemm_tests.txt"
      timeout 200 python3 -m bench.qgemm --out "$OUT" 2>&1 | quiet | tail -10 ;;
    zoo)
      timeout 570 python3 -m bench.zoo --models "${ZOO_MODELS:-all}" --precompile 12 --profile --deadline-s 450 \
        --out "$OUT" 2>&1 | quiet | tail -30 ;;
    bert)
      timeout 280 python3 -m bench.engine --models bert_base --precisions tf32,fp16 --batches 1,8,64 \
        --peers eager,reduce-overhead --compile-batches 1,8,64 --profile --out "$OUT" 2>&1 | quiet | tail -12 ;;
    resnet)
      timeout 330 python3 -m bench.engine --models resnet50 --precisions tf32,fp16 --batches 1,8,32,128 \
        --peers eager,reduce-overhead --compile-batches 1,8,32,128 --out "$OUT" 2>&1 | quiet | tail -14 ;;
    strict)
      timeout 240 python3 -m bench.engine --models resnet50 --precisions fp32,tf32 --batches 128 --peers eager \
        --out "$OUT" 2>&1 | quiet | tail -8 ;;
    autotune)
      # compiles take 80-115 s per BERT shape: session 4 measured BERT batch 1 and 64 (bench/results/engine_autotune_*);
      # this runs what is left, one invocation per shape so a timeout keeps the shapes already measured
      timeout 160 python3 -m bench.engine --models bert_base --precisions tf32 --batches 8 \
        --peers max-autotune-no-cudagraphs --compile-batches 8 --out "$OUT" 2>&1 | quiet | grep -v "^E1" | tail -3
      for batch in 128 8; do
        timeout 200 python3 -m bench.engine --models resnet50 --precisions tf32 --batches $batch \
          --peers max-autotune-no-cudagraphs --compile-batches $batch --out "$OUT" 2>&1 | quiet | grep -v "^E1" | tail -3
      done ;;
    int8)
      # which int8-output cuBLASLt configurations this GPU has (session 4: the build's probe said none, unexplained)
      timeout 30 python3 -m engine_core.backends.cuda.int8_gemm 2>&1 | tee "$OUT/int8_requant_probe.json" | tail -20
      cp bench/results/int8_calib_*.cache "$OUT"/ 2>/dev/null  # committed calibration caches skip host calibration
      timeout 480 python3 -m bench.int8 --out "$OUT" --variants fp16,int8_implicit_percentile,int8_explicit,int8_explicit_floatconv \
        --profile 2>&1 | quiet | tail -34
      timeout 60 python3 -m bench.accuracy --out "$OUT" 2>&1 | quiet | tail -6 ;;
    cudnn_int8)
      timeout 200 python3 -m bench.cudnn_int8 --out "$OUT" 2>&1 | quiet | tail -32 ;;
    conformance)
      mkdir -p /tmp/conf
      seq 0 47 | xargs -P 14 -I{} sh -c 'timeout 240 python3 -m engine_core.conformance --backend cuda --trace \
        --shard {}/48 --json /tmp/conf/c{}.json > /tmp/conf/log{} 2>&1 || echo "shard {} rc=$?" >> /tmp/conf/failed'
      python3 -m engine_core.conformance --from-json /tmp/conf/c*.json --backend cuda \
        --markdown "$OUT/conformance_cuda.md" --json "$OUT/conformance_cuda.json" | tail -2
      cat /tmp/conf/failed 2>/dev/null ;;
    faults)  # nvidia-ml-py (from wheels/ when there) gives the server's nv_gpu_memory_used_bytes; else nvidia-smi's figure
      python3 -m pip install -q --no-index --no-deps --find-links "${WHEELS:-wheels}" nvidia-ml-py 2>&1 | tail -1
      timeout 570 python3 load_tests/gpu_faults.py --device gpu --out "$OUT" --after-s 2 --budget-s 540 2>&1 \
        | grep -v -e Warning -e "warnings.warn" | tail -30 ;;
    serving_ab)  # #29: the core's executor I/O on its event loop against worker threads, and preferred sizes,
      # alternating in one call (machines differ: same-call ratios only); plans built once in $KILN_CACHE_DIR
      for round in 1 2; do
        for io in thread loop; do
          for model in bert resnet50; do
            transports=grpc; [ $model = resnet50 ] && transports=grpc,http
            echo "-- round $round $model KILN_EXECUTOR_IO=$io"
            KILN_EXECUTOR_IO=$io KILN_HOP_STATS_S=2 timeout 170 python3 load_tests/gpu_serving.py --models $model \
              --transports $transports --variants batched --concurrency 64 --cache-dir "$KILN_CACHE_DIR" \
              --raw-seconds 0.1 --window-s 3 --max-trials 2 --out /tmp/ab/$model-$io-$round 2>&1 | grep -A2 "^model "
            grep -h "hops (core)" /tmp/ab/$model-$io-$round/*.log 2>/dev/null | tail -1
          done
        done
      done
      echo "-- bert --preferred-batch-sizes 16,32"
      KILN_HOP_STATS_S=2 timeout 120 python3 load_tests/gpu_serving.py --models bert --transports grpc --variants batched \
        --concurrency 64 --cache-dir "$KILN_CACHE_DIR" --raw-seconds 0.1 --window-s 3 --max-trials 2 \
        --preferred-batch-sizes 16,32 --out /tmp/ab/bert-preferred 2>&1 | grep -A2 "^model "
      python3 - "$OUT" <<'PY'
import json, pathlib, sys
rows = {}
for path in sorted(pathlib.Path("/tmp/ab").glob("*/gpu_serving.json")):
    rows[path.parent.name] = json.loads(path.read_text())["rows"]
(pathlib.Path(sys.argv[1]) / "serving_ab.json").write_text(json.dumps(rows, indent=1))
PY
      ;;
    *) echo "unknown stage $stage" ;;
  esac
done
