#!/usr/bin/env bash
# Train the bundled S4 DeltaProduct_2[-1,1] model on one GPU within a time budget, then evaluate it.
#   usage: scripts/train_s4_gpu.sh RUN_DIR [SECONDS=420] [SEED=0]
# A 30-step probe measures the step time; the real run's cosine schedule then spans as many
# steps as fit in SECONDS.
set -euo pipefail
run=${1:?run dir}; budget=${2:-420}; seed=${3:-0}
export DELTALAB_KERNEL=torch
DL=${DELTALAB_CMD:-deltalab}
rm -rf /tmp/s4-probe
$DL train S4 --out /tmp/s4-probe --steps 30 --device cuda --log-every 10 --seed "$seed" >/dev/null 2>&1
per_step=$(python3 -c "import json; r=[json.loads(l) for l in open('/tmp/s4-probe/train_log.jsonl') if '\"train\"' in l]; print((r[-1]['elapsed_s']-r[0]['elapsed_s'])/(r[-1]['step']-r[0]['step']))")
steps=$(python3 -c "print(int($budget / $per_step) // 100 * 100)")
echo "step time ${per_step}s -> ${steps} steps"
$DL train S4 --out "$run" --steps "$steps" --device cuda --log-every 50 --save-every 500 --seed "$seed"
$DL eval "$run" --task S4 --lengths 128,256,512 --samples 2000 --json
