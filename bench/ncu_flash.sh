#!/usr/bin/env bash
# ncu of the flash attention kernel (BERT-base batch 64, int8 output) alone and inside BERT-base INT8, on the GPU
# machine: why it takes ~50 us a layer inside the model and 38 alone (docs/next-steps.md). Same sections for both:
# speed of light, warp states with their details (stall reasons: "no instruction" = instruction fetch), instruction
# and scheduler statistics.
#   bash bench/ncu_flash.sh OUT_DIR
# NCU_SOURCE=1: the kernel alone's SASS source page instead, summarized by bench/ncu_source.py.
set -o pipefail
out=${1:?output directory}
ncu=${NCU:-/usr/local/cuda/bin/ncu}
if [ "${NCU_SOURCE:-0}" = 1 ]; then
  timeout 150 "$ncu" --kernel-name regex:flash_attention_q_64 --launch-skip 1 --launch-count 1 --section WarpStateStats \
    --section SourceCounters --page source --print-source sass --csv \
    python3 -m bench.attention --cases 0 --profile-runs > "$out/ncu_flash_source.csv" 2>&1
  python3 -m bench.ncu_source "$out/ncu_flash_source.csv" | tee "$out/ncu_flash_source.txt" | head -60
  exit
fi
sections="--section SpeedOfLight --section WarpStateStats --section InstructionStats --section SchedulerStats --print-details all"
timeout 150 "$ncu" --kernel-name regex:flash_attention_q_64 --launch-skip 1 --launch-count 1 $sections \
  python3 -m bench.attention --cases 0 --profile-runs > "$out/ncu_flash_alone.txt" 2>&1
# in the model: the int8 variant's timed runs (its accuracy pass launches the kernel 12 times first)
cp bench/results/int8_calib_*.cache "$out"/ 2>/dev/null
timeout 420 "$ncu" --kernel-name regex:flash_attention_q_64 --launch-skip 30 --launch-count 1 $sections \
  python3 -m bench.int8 --models bert_base --variants int8_explicit --batches 64 --peer-batches "" --iters 3 \
  --sequences 64 --out "$out" > "$out/ncu_flash_in_model.txt" 2>&1
for f in alone in_model; do
  echo "== $f"
  grep -E "Duration|Issue Slots Busy|Warp Cycles Per Issued|Stall|No Instruction|Executed Ipc|SM Busy" "$out/ncu_flash_$f.txt" | head -24
done
