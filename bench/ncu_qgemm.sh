#!/usr/bin/env bash
# ncu of Kiln's sm_90 INT8 GEMM kernels at BERT-base batch 64 (8192 rows), one launch per bench.qgemm case, on the
# GPU machine: speed of light, memory (shared-memory and L2 throughput), warp stall and pipe utilization sections.
#   bash bench/ncu_qgemm.sh OUT_DIR [CASES]     (CASES: bench.qgemm --cases indexes, default 0,1,2)
# NCU_SOURCE=1 also collects the SASS source page (per-instruction executions and stall samples) and summarizes it
# with bench/ncu_source.py (instructions per output element and warp; loops and phases by their stall samples).
set -o pipefail
out=${1:?output directory}
ncu=${NCU:-/usr/local/cuda/bin/ncu}
for case in $(echo "${2:-0,1,2}" | tr , ' '); do
  timeout 240 "$ncu" --kernel-name regex:qgemm_sm90 --launch-count 1 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
    --section LaunchStats --section Occupancy \
    python3 -m bench.qgemm --rows 8192 --cases "$case" --profile-runs > "$out/ncu_qgemm_case$case.txt" 2>&1
  grep -E "qgemm_sm90|Duration|Compute \(SM\) Throughput|Memory Throughput|Shared|L2 Cache Throughput|Issue Slots Busy|Stall|Executed Ipc" \
    "$out/ncu_qgemm_case$case.txt" | head -30
done
if [ "${NCU_SOURCE:-0}" = 1 ]; then
  for case in $(echo "${2:-0,1,2}" | tr , ' '); do
    timeout 240 "$ncu" --kernel-name regex:qgemm_sm90 --launch-count 1 --section WarpStateStats --section SourceCounters \
      --page source --print-source sass --csv \
      python3 -m bench.qgemm --rows 8192 --cases "$case" --profile-runs > "$out/ncu_qgemm_source_case$case.csv" 2>&1
    python3 -m bench.ncu_source "$out/ncu_qgemm_source_case$case.csv" | tee "$out/ncu_qgemm_source_case$case.txt" | head -45
  done
fi
