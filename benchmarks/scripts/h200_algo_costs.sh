#!/usr/bin/env bash
# Per-algorithm cost on one V4-Flash-shaped layer (issue 13 item 4): a 3-layer synthetic Flash
# checkpoint (layer 2: compress ratio 4, hash routing: attention with compressor + indexer, 256
# routed experts, the shared expert), then bench_ptq (the main job's code path) on layer 2 for each
# algorithm at one calibration for all (CALIB x SEQ, default 16 x 2048), w8a8 weights + the scheme's
# activations. Writes $OUT/algo_*.json and logs. Usage: OUT=dir bash benchmarks/scripts/h200_algo_costs.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SYN=${SYN:-/tmp/syn_flash}
SCHEME=${SCHEME:-w8a8}
[ -f "$SYN/model.safetensors.index.json" ] || python3 tools/make_synthetic_checkpoint.py --like v4-flash --layers 3 \
    --no-mtp-block --out "$SYN" --device cuda 2>&1 | tail -2
for algo in ${ALGOS:-rtn gptq:sequential=false gptq clip smoothquant,gptq awq autoround}; do
  tag=$(echo "$algo" | tr ':=,' '___')
  rm -rf /tmp/w_algo
  timeout -s INT "${LIMIT:-150}" python3 benchmarks/bench_ptq.py --device cuda --model-path "$SYN" --start-layer 2 \
      --end-layer 3 --algo "$algo" --calib-samples "${CALIB:-16}" --seq-len "${SEQ:-2048}" --workdir /tmp/w_algo \
      --json "$OUT/algo_$tag.json" -- --scheme "$SCHEME" > "$OUT/algo_$tag.log" 2>&1
  echo "$algo rc=$?"; grep -E "unit seconds|solve:|capture:|\[solve\]" "$OUT/algo_$tag.log" | tail -12
done
