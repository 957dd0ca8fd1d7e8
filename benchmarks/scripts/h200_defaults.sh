#!/usr/bin/env bash
# Every built-in scheme's default recipe on one V4-Flash ratio-4 layer at the default calibration
# (issue 24 item 4): a 3-layer synthetic V4-Flash checkpoint (layer 2: compress ratio 4, hash
# routing: attention with compressor + indexer, 256 routed experts, the shared expert), then
# bench_ptq (the main job's own code path) on layer 2 for each scheme in $SCHEMES with no --algo
# (so the scheme's default recipe), and for each algo in $GPTQ_ALGOS on w8a8. One table:
# $OUT/defaults.md (from the JSONs, benchmarks/scripts/defaults_table.py). Usage:
#   OUT=dir SCHEMES="w4a16-g128 w8a8" bash benchmarks/scripts/h200_defaults.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SYN=${SYN:-/tmp/syn_flash}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
[ -f "$SYN/model.safetensors.index.json" ] || python3 tools/make_synthetic_checkpoint.py --like v4-flash --layers 3 \
    --no-mtp-block --out "$SYN" --device cuda 2>&1 | tail -2
echo "checkpoint ready: $(( $(date +%s) - t0 )) s"
run() {   # tag, limit, bench args...
  local tag=$1 limit=$2; shift 2
  rm -rf /tmp/w_def
  local t=$(date +%s)
  timeout -s INT "$limit" python3 benchmarks/bench_ptq.py --device cuda --model-path "$SYN" --start-layer 2 \
      --end-layer 3 --calib-samples "${CALIB:-128}" --seq-len "${SEQ:-2048}" --workdir /tmp/w_def \
      --json "$OUT/def_$tag.json" "$@" > "$OUT/def_$tag.log" 2>&1
  echo "$tag rc=$? wall=$(( $(date +%s) - t )) s"
  grep -E "solved jointly|solved in|^\[phase\]|unit seconds|rss|peak" "$OUT/def_$tag.log" | tail -14
}
for s in ${SCHEMES:-w4a16-g128 w8a8}; do run "$s" "${LIMIT:-400}" -- --scheme "$s"; done
for a in ${GPTQ_ALGOS:-}; do run "$(echo "$a" | tr ':=,' '___')" "${LIMIT:-400}" --algo "$a" -- --scheme w8a8; done
python3 benchmarks/scripts/defaults_table.py "$OUT"/def_*.json > "$OUT/defaults.md" 2>&1; cat "$OUT/defaults.md"
