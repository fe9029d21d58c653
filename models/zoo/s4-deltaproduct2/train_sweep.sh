#!/usr/bin/env bash
# Train three S4 recipes side by side on one GPU for SECONDS each, then evaluate each at 128 and 512.
#   usage: models/zoo/s4-deltaproduct2/train_sweep.sh OUT_DIR [SECONDS=380]
# Recipes: A = length 128, batch 256; B = length 32, batch 1024; C = length 16, batch 1024.
set -uo pipefail
out=${1:?out dir}; secs=${2:-380}
DL=${DELTALAB_CMD:-deltalab}
export DELTALAB_KERNEL=torch
common=(--device cuda --lr 1e-3 --warmup-steps 100 --log-every 100 --eval-every 0 --save-every 0 --time-limit "$secs")
$DL train S4 --out "$out/A" --batch-size 256 --train-length 128 --steps 6000 "${common[@]}" > "$out/A.log" 2>&1 &
$DL train S4 --out "$out/B" --batch-size 1024 --train-length 32 --steps 8000 "${common[@]}" > "$out/B.log" 2>&1 &
$DL train S4 --out "$out/C" --batch-size 1024 --train-length 16 --steps 12000 "${common[@]}" > "$out/C.log" 2>&1 &
wait
for r in A B C; do
  echo "== $r $(tail -1 "$out/$r/train_log.jsonl")"
  $DL eval "$out/$r" --task S4 --lengths 128,512 --samples 1000 --json 2>/dev/null | tail -1
done
