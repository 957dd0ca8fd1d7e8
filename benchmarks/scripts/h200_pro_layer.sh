#!/usr/bin/env bash
# One V4-Pro-shaped layer's PTQ on one GPU (issue 15 item 4): a 1-layer synthetic V4-Pro
# checkpoint in the release layout (layer 0: compress ratio 128, hash routing), then the main
# job's own code path through bench_ptq at the default calibration (128 x 2048), w8a8 with the
# default recipe (RTN) and with gptq:sequential=false (Hessians in capture passes that fit the
# device budget). Writes $OUT/pro_*.json and logs. Usage: OUT=dir bash benchmarks/scripts/h200_pro_layer.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SYN=${SYN:-/tmp/syn_pro}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$(date +%s)
[ -f "$SYN/model.safetensors.index.json" ] || python3 tools/make_synthetic_checkpoint.py --like v4-pro --layers 1 \
    --no-mtp-block --out "$SYN" --device cuda 2>&1 | tail -3 | tee "$OUT/pro_gen.log"
echo "generate: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/pro_gen.log"; df -h /tmp | tail -1 | tee -a "$OUT/pro_gen.log"
for algo in ${ALGOS:-rtn gptq:sequential=false}; do
  tag=$(echo "$algo" | tr ':=,' '___')
  rm -rf /tmp/w_pro
  timeout -s INT "${LIMIT:-330}" python3 benchmarks/bench_ptq.py --device cuda --like v4-pro --model-path "$SYN" \
      --start-layer 0 --end-layer 1 --algo "$algo" --workdir /tmp/w_pro --json "$OUT/pro_$tag.json" ${EXTRA:+-- $EXTRA} \
      > "$OUT/pro_$tag.log" 2>&1
  echo "$algo rc=$?"; grep -E "^\[phase\]|unit seconds|projection|==== |^ *0 " "$OUT/pro_$tag.log" | tail -25
  du -sh /tmp/w_pro 2>/dev/null
done
