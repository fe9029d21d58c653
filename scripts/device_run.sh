#!/usr/bin/env bash
# One device call's worth of GPU work, by section; logs and JSON go to $OUT (the device tool's folder).
#   usage (on the device, from the repo root, after the wheel install line of ../shared/device/README.md):
#     bash scripts/device_run.sh s4 | tests | kernels | kda | analysis | probes | store | dist | attention | rwkv7fix | rwkv7 | verify | reduce | table | secular | spectra19 | statetile | keysws | aqk | fromv | fromvw | keysfv | evict | pair | tma | trans | tfull | kktgroup | g0 | nogate | grid | maxnreg | outload | devmap [more ...]
# s4:      continue the bundled S4 model (trained up to length 128) at 128, then 256, and evaluate it
# tests:   the GPU-marked tests (realistic shapes, fla 0.6.0 comparisons)
# kernels: python -m benchmarks.kernels (forward vs fla, accuracy; ~10 min on an H200 at 3 rounds with .triton-autotune
#          carried, so a call of its own; the accuracy table runs last and compiles per dtype)
# kda:     (KDA_TESTS=0 skips the tests; KDA_BUDGET, default 240 s, bounds the benchmark) the Triton KDA forward's GPU tests (float64, fla's chunk_kda when importable) and python -m benchmarks.kda
#          (ours vs fla, same run; no new row after 240 s, then our per-kernel profile): under ~8 min on an H100
# analysis: python -m benchmarks.kernels_analysis (spectra incl. windows, state ranks vs the authors' loop)
# probes:  erank/spectra probe throughput (python -m benchmarks.probes) on a GPU capture of the bundled model
# store:   capture vs plain forward, write rate vs dd, memory (benchmarks.store) on the GPU; hidden 512 and 1024
# attention: exact attention maps (unmeasured; timeouts bound it to 8 min): the T=4096 GPU tests of the
#          Triton kernel, one pytest per case under its own timeout (n_h 1, 2 x scalar, per-channel gates), then
#          python -m benchmarks.attention at T=4096 (n_h 1, 2 x both gates; fp64 oracle and dense Phi extrapolated)
# rwkv7fix: only the fixtures of the rwkv7 section (float32 first, then fla's bf16 chunk_rwkv7 logits), under
#          RWKV7_FIX_S seconds (default 300), into $OUT/fla.tar
# rwkv7:   regenerate the rwkv7 fixtures on CUDA (tests/fixtures/make_fla_fixtures.py --rwkv7: adds fla's bf16
#          logits_bf16 from chunk_rwkv7) into $OUT/fla.tar (folders + report.json to unpack into tests/fixtures/), put
#          them in place on the device, then the rwkv7 GPU tests (model vs fla incl. bf16 through fla's
#          chunk_dplr_delta_rule, kernels.dplr_fla vs float64, rwkv7 probes); timeouts bound it to ~8 min
# reduce:  #19: OLMo-Hybrid 7.4B (transformers default config, random bf16) captured with --reduce ranks,spectra
#          at B x T = 8 x 4096 (REDUCE_B / REDUCE_T / REDUCE_MODES to change; peak 80 GB), the plain forward in the
#          same run, each reduction alone (--stages), then without the reductions' writes; ~7 minutes
# table:   #19's table at 8 x 4096: reductions over 12 batches, then the default hooks (1 batch) and states kept
# secular: the Triton secular solver's GPU tests, scripts/secular_diag.py (FMA contraction on and off), and
#          python -m benchmarks.spectra_dplr --dk 64 128 (Triton, torch and dense in one run), all under $OUT
# verify:  GPU tests of the delta-rule and KDA forwards (both changed shape after their last GPU run) and
#          scripts/kda_split_check.py (KDA prep: persistent vs split vs fla); carry .triton-autotune for fla
# spectra19: the spectra reduction's GPU tests, then scripts/spectra_reduce_profile.py
# statetile: the sequential kernel with 64/128-wide value tiles at 8-16 warps vs the default and fla
#          (scripts/config_ab.py); ~5 minutes
# keysws:  the sequential kernel with W S from the keys and T (state_keys_ws: GPU tests, then vs the default and fla)
# aqk:     the output kernel reading q K^T * decay * mask from the kkt kernel (out_aqk: GPU tests, vs default and fla)
# keysfv:  the keys path with U from v at 8 warps, 64-wide tiles, 1 or 3 stages (8x4096 and packed rows)
# fromvw:  U from v on the W path (B = 1), 32- and 64-wide value tiles (GPU tests, vs default and fla)
# evict:   L2 eviction hints on the chunk states and D (GPU tests, then vs the default and fla)
# tma:     the state kernel's stores through tensor descriptors (state_tma: GPU tests, then vs the default and fla)
# maxnreg: the state kernel at 168 registers a thread (state_maxnreg), alone and with state_tma, vs the default and fla
# pair:    the output chunk pairs with q K'^T from the kkt kernel (out_pair: GPU tests, then vs the default and fla)
# fromv:   U from v in the sequential kernel (state_from_v; GPU tests, W-path errors, vs reading U and fla)
# outload: the output kernel with its loads a key block ahead (out_prefetch: GPU tests, then vs the default and fla)
#          and at 2-3 pipeline stages (o's difference from the default shows a miscompile); ~6 minutes
# devmap:  scripts/device_map_check.py same (one GPU vs device_map auto/balanced; DEVMAP_SAME=0 skips it) and big
#          (Qwen3-Next 80B on the GPUs, --reduce ranks,spectra): on nvidia-h200-x2, about 5 minutes
# dist:    torchrun capture on every GPU of the machine (NCCL) against one GPU; same values (nvidia-h200-x2)
# Autotuning: fla 0.6.0 benches every config on first use (chunk_kda: 80 s, chunk_rwkv7: over 200 s on an H200,
# which ate whole device calls). TRITON_CACHE_AUTOTUNING keeps the timings on disk; each run returns them as
# $OUT/autotune.tar. Copy that file to .triton-autotune/autotune.tar here (git-ignored) and add
# ".triton-autotune" to the next call's carry: the chosen configs are then compiled once and not re-benched.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .triton-autotune/autotune.tar ] && tar xf .triton-autotune/autotune.tar -C "$TRITON_CACHE_DIR"
save_autotune() { (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar cf "$OUT/autotune.tar" -T -); }
trap save_autotune EXIT
DL="python3 -m app.cli"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
for section in "$@"; do
  case "$section" in
    s4)
      DELTALAB_KERNEL=torch $DL train S4 --out /tmp/s4-128 --init-from models/zoo/s4-deltaproduct2 --device cuda \
        --batch-size 512 --train-length 128 --steps 1500 --lr 2e-4 --warmup-steps 50 --log-every 100 --eval-every 0 \
        --save-every 0 --time-limit 150 2>&1 | tail -3 | tee "$OUT/s4-128.log"
      DELTALAB_KERNEL=torch $DL train S4 --out /tmp/s4-256 --init-from /tmp/s4-128 --device cuda \
        --batch-size 256 --train-length 256 --steps 1500 --lr 1e-4 --warmup-steps 50 --log-every 100 --eval-every 0 \
        --save-every 0 --time-limit 150 2>&1 | tail -3 | tee "$OUT/s4-256.log"
      $DL eval /tmp/s4-256 --task S4 --lengths 128,512 --samples 1000 --out /tmp/s4-256 --json | tee "$OUT/s4-eval.json"
      (cd /tmp/s4-256 && tar cf "$OUT/s4-256.tar" config.json model.safetensors train_log.jsonl task.json \
        train_config.json length_curve.json) ;;
    tests)
      python3 -m pytest -q -m gpu tests 2>&1 | tail -30 | tee "$OUT/gpu-tests.log" ;;
    kernels)
      python3 -m benchmarks.kernels --skip analysis --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" ;;
    kda)
      [ "${KDA_TESTS:-1}" = 1 ] && python3 -m pytest -q -m gpu -rA tests/kernels/test_triton_kda.py --durations=0 2>&1 \
        | tail -60 | tee "$OUT/kda-tests.log"
      python3 -m benchmarks.kda --budget "${KDA_BUDGET:-240}" --profile 2>&1 | tee "$OUT/kda-bench.txt" ;;
    analysis)
      python3 -m benchmarks.kernels_analysis --targets spectra,ranks --out "$OUT/bench_analysis.json" 2>&1 \
        | tee "$OUT/bench_analysis.txt" ;;
    probes)
      $DL capture models/zoo/s4-deltaproduct2 --data S4:length=512,samples=128,seed=1 --out /tmp/s4.zarr \
        --device cuda --batch-size 64 2>&1 | tail -2
      python3 -m benchmarks.probes --store /tmp/s4.zarr --device cuda --repeat 2 --json | tee "$OUT/probe-bench-gpu.json"
      python3 -m benchmarks.probes --store /tmp/s4.zarr --device cpu --json | tee "$OUT/probe-bench-cpu.json" ;;
    store)
      python3 -m benchmarks.store --device cuda --length 512 --samples 256 --batch-size 32 --hidden 512 \
        --json-out "$OUT/store-bench.json" 2>&1 | tee "$OUT/store-bench.txt"
      python3 -m benchmarks.store --device cuda --length 512 --samples 256 --batch-size 32 --hidden 1024 --layers 4 \
        --skip-memory --json-out "$OUT/store-bench-1024.json" 2>&1 | tee "$OUT/store-bench-1024.txt" ;;
    dist)
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # required on shared hosts
      python3 scripts/dist_capture_check.py --gpus "$(nvidia-smi -L | wc -l)" --json "$OUT/dist.json" 2>&1 \
        | tee "$OUT/dist.txt" ;;
    attention)
      # the first case of each n_h compiles its kernels (about 20-40 s); the channel cases reuse them
      for case in 1-scalar:100 2-scalar:100 1-channel:75 2-channel:75; do
        timeout "${case#*:}" python3 -m pytest -q -s -m gpu -p no:cacheprovider \
          "tests/kernels/test_attention_triton.py::test_triton_gpu_4096_tokens[${case%:*}]" 2>&1 | tail -4 \
          | tee -a "$OUT/attention-gpu-tests.log"
        echo "[${case%:*}] exit ${PIPESTATUS[0]} (124: past ${case#*:} s)" | tee -a "$OUT/attention-gpu-tests.log"
      done
      timeout 130 python3 -m benchmarks.attention --T 4096 --n-h 1 2 --gate scalar channel \
        --json "$OUT/attention-bench.json" 2>&1 | tee "$OUT/attention-bench.txt" ;;
    rwkv7fix)
      mkdir -p "$OUT/fla" && cp tests/fixtures/fla/report.json "$OUT/fla/"  # the regenerated report keeps the rest
      timeout "${RWKV7_FIX_S:-300}" python3 tests/fixtures/make_fla_fixtures.py --rwkv7 "$OUT/fla" 2>&1 \
        | tee "$OUT/rwkv7-fixtures.log" | tail -20
      echo "fixtures exit ${PIPESTATUS[0]} (124: past ${RWKV7_FIX_S:-300} s)" | tee -a "$OUT/rwkv7-fixtures.log"
      (cd "$OUT" && tar cf fla.tar fla && rm -rf fla) ;;
    rwkv7)
      mkdir -p "$OUT/fla" && cp tests/fixtures/fla/report.json "$OUT/fla/"  # the regenerated report keeps the rest
      timeout 200 python3 tests/fixtures/make_fla_fixtures.py --rwkv7 "$OUT/fla" 2>&1 | tee "$OUT/rwkv7-fixtures.log" \
        | tail -20
      echo "fixtures exit ${PIPESTATUS[0]} (124: past 200 s)" | tee -a "$OUT/rwkv7-fixtures.log"
      for name in rwkv7_fused rwkv7_wide_v; do  # the tests below read the fresh fixtures (the device's copy)
        [ -f "$OUT/fla/$name/logits.safetensors" ] && cp -r "$OUT/fla/$name" tests/fixtures/fla/
      done
      timeout 270 python3 -m pytest -q -s -m gpu -rA -p no:cacheprovider --durations=0 tests/kernels/test_dplr_fla.py \
        tests/kernels/test_dplr_chunk.py tests/models/test_fla_rwkv7.py tests/probes/test_rwkv7_probes.py 2>&1 \
        | tee "$OUT/rwkv7-gpu-tests.log" | tail -40
      echo "tests exit ${PIPESTATUS[0]} (124: past 270 s)" | tee -a "$OUT/rwkv7-gpu-tests.log"
      (cd "$OUT" && tar cf fla.tar fla && rm -rf fla) ;;  # one file back (the device returns at most 8)
    secular)
      # #16: the Triton secular solver's GPU tests, the diag (bad rows per run, with and without FMA contraction,
      # start and float32 phase), then the spectra benchmark with its launch sweep (1e7 target)
      timeout 150 python3 -m pytest -q -m gpu -rA -p no:cacheprovider \
        tests/kernels/test_triton_secular.py > "$OUT/secular-tests.log" 2>&1; echo "tests exit $?" >> "$OUT/secular-tests.log"
      timeout 90 python3 scripts/secular_diag.py > "$OUT/secular-diag.txt" 2>&1
      timeout 240 python3 -m benchmarks.spectra_dplr --dk 64 128 --sweep > "$OUT/spectra-dplr.txt" 2>&1
      tail -4 "$OUT/secular-tests.log"; grep -v Warn "$OUT/secular-diag.txt" | tail -12; tail -6 "$OUT/spectra-dplr.txt" ;;
    verify)
      # the kernels that changed shape after their last GPU run (kernels/NOTES.md): the delta-rule forward's and the
      # KDA forward's GPU tests (split prep included), then persistent vs split prep vs fla at two grid points
      timeout 120 python3 scripts/kda_split_check.py > "$OUT/kda-split.txt" 2>&1
      timeout 220 python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/kernels/test_triton_kda.py \
        > "$OUT/verify-kda.log" 2>&1; echo "kda tests exit $?" >> "$OUT/verify-kda.log"
      timeout 200 python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/kernels/test_triton_chunk.py \
        > "$OUT/verify-chunk.log" 2>&1; echo "chunk tests exit $?" >> "$OUT/verify-chunk.log"
      tail -n 3 "$OUT/verify-chunk.log" "$OUT/verify-kda.log"; grep -v Warn "$OUT/kda-split.txt" ;;
    devmap)
      # #19 on two GPUs (nvidia-h200-x2): OLMo-Hybrid cut to 8 layers (2.44B) saved and captured on one GPU vs
      # device_map auto / balanced (bit-identical since the Triton device guard), then Qwen3-Next's default config
      # (79.7B, 159 GB bf16) built straight onto the GPUs and captured with reductions; about 5 minutes
      [ "${DEVMAP_SAME:-1}" = 1 ] && { timeout 140 python3 scripts/device_map_check.py same --layers 8 --batch 2 \
        --length 1024 --batches 2 --json "$OUT/devmap-same.json" > "$OUT/devmap-same.txt" 2>&1
        echo "same exit $?" | tee -a "$OUT/devmap-same.txt"; }
      timeout 240 python3 scripts/device_map_check.py big --batch 1 --length 2048 --batches 2 --rank-every 1024 \
        --json "$OUT/devmap-big.json" > "$OUT/devmap-big.txt" 2>&1; echo "big exit $?" | tee -a "$OUT/devmap-big.txt"
      tail -n 5 "$OUT"/devmap-*.txt ;;
    reduce)
      # #19 at the shape (8 x 4096, 6 timed batches: with 2 the pipeline's drain was half the time) with each
      # reduction alone on one batch (--stages), then without the reductions' writes (their whole cost); ~7 minutes
      timeout 260 python3 -m benchmarks.reduce_capture --family olmo_hybrid --default-config --batch "${REDUCE_B:-8}" \
        --length "${REDUCE_T:-4096}" --batches 6 --rank-every 1024 --reduce ranks,spectra \
        --modes "${REDUCE_MODES:-reduce}" --stages --json "$OUT/reduce.json" > "$OUT/reduce.txt" 2>&1
      echo "reduce exit $? (124: past 260 s)" | tee -a "$OUT/reduce.txt"; grep -B2 -A4 "x plain" "$OUT/reduce.txt"
      grep -A4 "alone" "$OUT/reduce.txt"
      timeout 150 python3 -m benchmarks.reduce_capture --family olmo_hybrid --default-config --batch "${REDUCE_B:-8}" \
        --length "${REDUCE_T:-4096}" --batches 6 --rank-every 1024 --reduce ranks,spectra --modes reduce --no-write \
        > "$OUT/reduce-nowrite.txt" 2>&1; echo "--no-write exit $?"; grep -A2 "x plain" "$OUT/reduce-nowrite.txt" ;;
    table)
      # #19's one-GPU table at 8 x 4096: the reductions over 12 batches (the drain's share halves against 6), then
      # the default hooks (one timed batch: every state in float16 is 32 GB) and reductions with states kept
      # (--state-every 8); the warm-up stores are removed before the timed ones; about 6 minutes (TABLE_REDUCE=0 skips
      # the 12-batch reductions row)
      df -h /tmp /dev/shm > "$OUT/table-df.txt" 2>&1
      [ "${TABLE_REDUCE:-1}" = 1 ] && timeout 200 python3 -m benchmarks.reduce_capture --family olmo_hybrid --default-config --batch 8 --length 4096 \
        --batches 12 --rank-every auto --reduce ranks,spectra --modes reduce --no-summary \
        --json "$OUT/reduce12.json" > "$OUT/reduce12.txt" 2>&1; echo "reduce12 exit $? (124: past 200 s)" >> "$OUT/reduce12.txt"
      timeout 300 python3 -m benchmarks.reduce_capture --family olmo_hybrid --default-config --batch 8 --length 4096 \
        --batches 3 --states-batches 1 --rank-every auto --reduce ranks,spectra --modes states,reduce+states \
        --no-summary --json "$OUT/states.json" > "$OUT/states.txt" 2>&1; echo "states exit $? (124: past 300 s)" >> "$OUT/states.txt"
      grep -A3 "x plain" "$OUT/reduce12.txt" "$OUT/states.txt"; tail -n 1 "$OUT/reduce12.txt" "$OUT/states.txt" ;;
    spectra19)
      # #19's spectra reduction: the GPU tests of the per-token pass and capture vs probes; then
      # scripts/spectra_reduce_profile.py (the window kernel by programs an SM); ~2 minutes. Follow with `reduce`.
      timeout 200 python3 -m pytest -q -m gpu -rA tests/kernels/test_triton_token_spectra.py \
        tests/store/test_reduce.py 2>&1 | tail -15 | tee "$OUT/spectra19-tests.log"
      timeout 200 python3 scripts/spectra_reduce_profile.py 2>&1 | grep -v "^ *$" | head -40 | tee "$OUT/spectra19.txt" ;;
    statetile)
      # #17: wider value tiles of the sequential kernel at 8 warps (fewer programs re-reading W and K from L2; the
      # default's per-step traffic is ~4.3-5 TB/s at GDN default and Qwen3-Next, kernels/NOTES.md), ours vs fla and
      # per-kernel profiles; each shape in its own process (a fault ends the CUDA context); ~5 minutes
      for shape in "GDN fla default" "Qwen3-Next grouped" "DeltaProduct n_h=2"; do
        timeout 150 python3 scripts/config_ab.py --shape "$shape" --profile --change state_bv=64,state_warps=8 \
          --change state_bv=128,state_warps=8 --change state_bv=128,state_warps=16 \
          --change state_bv=64,state_warps=8,state_stages=2 2>&1 | grep -v Warn | tee -a "$OUT/statetile.txt"
      done ;;
    keysws)
      # #17: the sequential kernel forming W S from the keys and T (state_keys_ws: 32 + 8 KB a step at dk 256 against
      # 64 KB of W and K): GPU tests against float64, then ours vs fla at the real rows with profiles; ~4 minutes
      timeout 150 python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/kernels/test_triton_keys_ws.py 2>&1 \
        | tail -8 | tee -a "$OUT/keysws.txt"
      for shape in "GDN fla default" "Qwen3-Next grouped" "DeltaProduct n_h=2" "DeltaProduct n_h=3"; do
        timeout 100 python3 scripts/config_ab.py --shape "$shape" --profile --change state_keys_ws=True \
          --change state_keys_ws=True,state_stages=3 2>&1 | grep -v Warn | tee -a "$OUT/keysws.txt"
      done ;;
    aqk)
      # #17: the intra-chunk attention q K^T formed once a chunk in the kkt kernel and read by the output kernel
      # (out_aqk; ptxas sm_90: the output kernel's spills go, 1432 -> 0 bytes at n_h = 3, 4 warps); GPU tests, then
      # vs the default and fla with the kkt kernel at 8 warps (no spills) and wider output tiles; ~8 minutes
      timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_triton_out_loops.py 2>&1 \
        | tail -4 | tee -a "$OUT/aqk.txt"
      for shape in "DeltaProduct n_h=3" "GDN fla default"; do
        timeout 160 python3 scripts/config_ab.py --shape "$shape" --sizes 8x4096,1x32768 --profile \
          --change out_aqk=True --change out_aqk=True,kkt_warps=8 --change out_aqk=True,kkt_warps=8,out_warps=8 \
          --change out_aqk=True,kkt_warps=8,out_bv=256,out_warps=8 2>&1 | grep -v Warn | tee -a "$OUT/aqk.txt"
      done ;;
    keysfv)
      # #17 past one wave (unmeasured): the keys path with U from v spills more at 4 warps (ptxas sm_90 stack bytes,
      # 2 stages: GDN default BV 32 512 -> 784, BV 64 1808 -> 2496; at 8 warps 232 and 1152), and its state kernel is
      # 0.778 ms at GDN default 8 x 4096 against fla's h kernel 0.701 (the row is 1.22x, 1.3x needs ~1.32 ms):
      # 8 warps, 64-wide tiles and one or three stages against the default, at 8 x 4096 and packed; ~6 minutes
      for shape in "GDN fla default" "DeltaProduct n_h=2"; do
        timeout 150 python3 scripts/config_ab.py --shape "$shape" --sizes 8x4096,varlen --profile \
          --change state_warps=8 --change state_warps=8,state_bv=64 --change state_stages=1 \
          --change state_stages=3 2>&1 | grep -v Warn | tee -a "$OUT/keysfv.txt"
      done ;;
    fromvw)
      # #17 at B = 1 (the W path, unmeasured): U from v there drops U from the WY kernel's writes (0.221 ms at GDN
      # default 1 x 32768, 0.447 at Qwen3-Next, which misses 1.3x by 0.03 ms) with U = T diag(beta) V off the step's
      # dependent chain; it runs at one stage at 32-wide value tiles (they miscompiled at 2-3), so also 64-wide tiles
      # (half the programs, right at every stage). GPU tests of those, then vs the default and fla at each 1 x 32768
      # row; ~8 minutes with .triton-autotune carried
      timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_triton_from_v.py -k "W or 64" \
        2>&1 | tail -4 | tee -a "$OUT/fromvw.txt"
      for shape in "GDN fla default" "Qwen3-Next grouped" "DeltaProduct n_h=3" "DeltaProduct n_h=2"; do
        timeout 90 python3 scripts/config_ab.py --shape "$shape" --sizes 1x32768 --profile --change state_from_v=True \
          --change state_bv=64 --change state_bv=64,state_from_v=True 2>&1 | grep -v Warn | tee -a "$OUT/fromvw.txt"
      done ;;
    evict)
      # #17: L2 eviction hints (state_evict_first: the state kernel stores chunk states and D evict-first;
      # out_evict_first: the output kernel loads the states evict-first). GPU tests (bit-identical), then each and
      # both against the default and fla; ~5 minutes
      timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_triton_evict.py 2>&1 \
        | tail -4 | tee -a "$OUT/evict.txt"
      for shape in "GDN fla default" "Qwen3-Next grouped"; do
        timeout 170 python3 scripts/config_ab.py --shape "$shape" --profile --change state_evict_first=True \
          --change out_evict_first=True --change state_evict_first=True,out_evict_first=True 2>&1 | grep -v Warn \
          | tee -a "$OUT/evict.txt"
      done ;;
    pair)
      # #17: the output kernel's chunk pairs, second form (out_pair with out_aqk: an odd chunk reads S_{c-1} and adds
      # Aqp D', q K'^T from the kkt kernel; the state kernel stores every other state, which took 0.03-0.10 ms off it
      # at GDN default in the first form). ptxas sm_90: output kernel spills 320 -> 328 bytes, kkt 216 -> 736 at 4
      # warps, none at 8. GPU tests, then against the default and fla; ~5 minutes
      timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_triton_out_pair.py 2>&1 \
        | tail -4 | tee -a "$OUT/pair.txt"
      timeout 200 python3 scripts/config_ab.py --shape "GDN fla default" --profile --change out_pair=True \
        --change out_pair=True,kkt_warps=8 --change kkt_warps=8 2>&1 | grep -v Warn | tee -a "$OUT/pair.txt"
      timeout 120 python3 scripts/config_ab.py --shape "Qwen3-Next grouped" --profile --change out_aqk=True \
        --change out_aqk=True,out_pair=True,kkt_warps=8 2>&1 | grep -v Warn | tee -a "$OUT/pair.txt" ;;
    tma)
      # #17: the sequential kernel's state stores through tensor descriptors (state_tma; ptxas sm_90, Triton 3.6:
      # spills a thread GDN default 848 -> 320 bytes, Qwen3-Next 800 -> 120). GPU tests (bit-identical), then against
      # the pointer stores and fla at every real shape; ~7 minutes
      timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_triton_tma.py 2>&1 \
        | tail -4 | tee -a "$OUT/tma.txt"
      timeout 170 python3 scripts/config_ab.py --shape "GDN fla default" --profile --change state_tma=True \
        --change state_tma=True,state_bv=64,state_warps=8 2>&1 | grep -v Warn | tee -a "$OUT/tma.txt"
      timeout 200 python3 scripts/config_ab.py --shape "Qwen3-Next grouped" --shape "DeltaProduct n_h=2" \
        --shape "DeltaProduct n_h=3" --profile --change state_tma=True 2>&1 | grep -v Warn | tee -a "$OUT/tma.txt" ;;
    trans)
      # #17: T loaded without a mask (state_t_full: the only way Triton pipelines that load) and the state held
      # transposed (state_trans: every product of the step takes its left operand from registers), at 32- and
      # 64-wide value tiles, against the default and fla; ~10 minutes (TRANS_TESTS=1 runs the GPU tests first)
      if [ "${TRANS_TESTS:-0}" = 1 ]; then
        timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_triton_trans.py 2>&1 \
          | tail -4 | tee -a "$OUT/trans.txt"
      fi
      timeout 300 python3 scripts/config_ab.py --shape "GDN fla default" --profile --change state_t_full=True \
        --change state_t_full=True,state_trans=True --change state_t_full=True,state_trans=True,state_bv=64 \
        --change state_t_full=True,state_trans=True,state_bv=64,state_warps=8 2>&1 | grep -v Warn \
        | tee -a "$OUT/trans.txt"
      timeout 270 python3 scripts/config_ab.py --shape "Qwen3-Next grouped" --shape "DeltaProduct n_h=2" \
        --sizes 8x4096,varlen --profile --change state_t_full=True --change state_t_full=True,state_trans=True \
        --change state_t_full=True,state_trans=True,state_bv=64 2>&1 | grep -v Warn | tee -a "$OUT/trans.txt" ;;
    tfull)
      # #17: with T unmasked (the default now), the GPU tests of test_triton_trans.py's t_full cases, then GDN
      # default's sequential kernel at 64-wide tiles (4 and 8 warps), three stages, 168 registers and evict-first
      # stores against the new default and fla; ~7 minutes
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_triton_trans.py -k t_full 2>&1 \
        | tail -4 | tee -a "$OUT/tfull.txt"
      timeout 330 python3 scripts/config_ab.py --shape "GDN fla default" --sizes 8x4096,varlen --profile \
        --change state_bv=64 --change state_bv=64,state_warps=8 --change state_stages=3 \
        --change state_maxnreg=168 --change state_evict_first=True 2>&1 | grep -v Warn | tee -a "$OUT/tfull.txt" ;;
    kktgroup)
      # #17: one kkt program for the value heads of a key head (kkt_group): GPU tests, then Qwen3-Next against the
      # default and fla, and the default's kernels at GDN default and DeltaProduct n_h = 2 (the kkt kernel's epilogue
      # became a function of the value head); ~4 minutes
      timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_triton_kkt_group.py 2>&1 \
        | tail -3 | tee -a "$OUT/kktgroup.txt"
      timeout 150 python3 scripts/config_ab.py --shape "Qwen3-Next grouped" --profile --change kkt_group=True 2>&1 \
        | grep -v Warn | tee -a "$OUT/kktgroup.txt"
      timeout 100 python3 scripts/config_ab.py --shape "GDN fla default" --shape "DeltaProduct n_h=2" --sizes 8x4096 \
        --profile 2>&1 | grep -v Warn | tee -a "$OUT/kktgroup.txt" ;;
    g0)
      # #17 (fifteenth session; measured in the sixteenth, 1.00-1.02x, now the default, so the changes below are
      # measured against False): n_h > 1 blocks take their starting log decay from the previous block
      # (state_g0_ahead) instead of a synchronous scalar load in every block's chain. GPU tests (bit-identical), then
      # grid points and the DeltaProduct rows against the default and fla; ~6 minutes
      timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_triton_g0_ahead.py 2>&1 \
        | tail -3 | tee -a "$OUT/g0.txt"
      timeout 120 python3 scripts/grid_ab.py --point 1,8192,2,off --point 1,8192,3,off --point 1,8192,3,on \
        --point 8,8192,3,on --change state_g0_ahead=False --profile 2>&1 | grep -v Warn | tee -a "$OUT/g0.txt"
      timeout 150 python3 scripts/config_ab.py --shape "DeltaProduct n_h=2" --shape "DeltaProduct n_h=3" --profile \
        --change state_g0_ahead=False 2>&1 | grep -v Warn | tee -a "$OUT/g0.txt"
      # and the WY kernel's T load unmasked (wu_t_full) on the W path (B = 1 rows)
      timeout 120 python3 scripts/config_ab.py --shape "Qwen3-Next grouped" --shape "GDN fla default" --sizes 1x32768 \
        --profile --change wu_t_full=False 2>&1 | grep -v Warn | tee -a "$OUT/g0.txt" ;;
    nogate)
      # #17 (sixteenth session): the output kernel without gates (USE_G false, built after the device budget was spent:
      # interpreter only) and the state kernel's (GPU-tested): GPU tests, the worst grid point's kernels against fla's,
      # then the grid twice (fla's B = 1 times move with the host); 5-9 minutes with .triton-autotune carried
      timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_triton_no_gate.py 2>&1 | tail -3 \
        | tee -a "$OUT/nogate.txt"
      timeout 60 python3 scripts/grid_ab.py --point 1,8192,3,off --point 1,8192,2,off --profile 2>&1 | grep -v Warn \
        | tee -a "$OUT/nogate.txt"
      # every kernel on mma.sync (v2) instead of wgmma: at B = 1 the state kernel's step latency binds (32 programs),
      # and fla's h kernel, 7% faster there, may run at 2 warps, i.e. on v2 (a cache-invalidating variable: its own
      # compiles); the profile's state kernel line is the figure to compare
      echo "== DISABLE_MMA_V3=1" | tee -a "$OUT/nogate.txt"
      DISABLE_MMA_V3=1 timeout 240 python3 scripts/grid_ab.py --point 1,8192,3,off --point 1,8192,2,off --profile 2>&1 \
        | grep -v Warn | tee -a "$OUT/nogate.txt"
      for run in 1 2; do
        timeout 110 python3 -m benchmarks.kernels --skip real,accuracy,analysis --json "$OUT/grid$run.json" 2>&1 \
          | grep -v Warn | tee -a "$OUT/nogate.txt"
      done ;;
    grid)
      # #17: the grid alone (B 1, 8 x T 2048, 8192 x n_h 1-3 x gate; o+fin judged), JSON to $OUT; over 4 minutes on a
      # fresh machine (fla's autotuning of the grid shapes), so a call of its own; GRID_SIZES=1x8192,8x2048 limits it
      timeout 560 python3 -m benchmarks.kernels --skip real,accuracy,analysis --json "$OUT/grid.json" \
        ${GRID_SIZES:+--grid-sizes "$GRID_SIZES"} 2>&1 \
        | grep -v Warn | tee -a "$OUT/grid.txt" ;;
    maxnreg)
      # #17: the sequential kernel capped at 168 registers a thread (state_maxnreg), three 4-warp programs an SM
      # instead of two (GDN default 8 x 4096: 768 programs in two waves, not three), alone and with state_tma (ptxas
      # sm_90, Triton 3.6: 856 / 1472 bytes spilled with / without); ~4 minutes
      timeout 170 python3 scripts/config_ab.py --shape "GDN fla default" --profile --change state_maxnreg=168 \
        --change state_maxnreg=168,state_tma=True 2>&1 | grep -v Warn | tee -a "$OUT/maxnreg.txt"
      timeout 150 python3 scripts/config_ab.py --shape "Qwen3-Next grouped" --shape "DeltaProduct n_h=2" \
        --sizes 8x4096,varlen --profile --change state_maxnreg=168,state_tma=True 2>&1 | grep -v Warn \
        | tee -a "$OUT/maxnreg.txt" ;;
    fromv)
      # #17: U from v in the sequential kernel (state_from_v, the default on the keys path since the twelfth session:
      # 8x4096 GDN default 1.11x, Qwen3-Next 1.15x, DeltaProduct n_h = 3 1.13x against reading U; the state kernel
      # holds its time and the WY kernel is not launched). The W path with it miscompiled at 32-wide value tiles and
      # 2-3 stages, so it runs there at one stage: scripts/fromv_check.py prints the errors per stages and tile.
      # GPU tests, the check, then the keys path against reading U at the packed rows and DeltaProduct n_h = 2;
      # ~8 minutes with .triton-autotune carried (fla's autotuning alone took the last shapes' time without it)
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_triton_from_v.py 2>&1 \
        | tail -4 | tee -a "$OUT/fromv.txt"
      timeout 120 python3 scripts/fromv_check.py 2>&1 | grep -v Warn | tee -a "$OUT/fromv.txt"
      timeout 200 python3 scripts/config_ab.py --shape "DeltaProduct n_h=2" --shape "GDN fla default" \
        --sizes 8x4096,varlen --profile --change state_from_v=False 2>&1 | grep -v Warn | tee -a "$OUT/fromv.txt" ;;
    outload)
      # #17: the output kernel with its loads one key block ahead (out_prefetch; GPU tests first), and pipelined by
      # the compiler (miscompiled on Triton 3.9 in the sixth session: o's difference shows it); ~6 minutes
      timeout 150 python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/kernels/test_triton_out_loops.py 2>&1 \
        | tail -8 | tee -a "$OUT/outload.txt"
      for shape in "GDN fla default" "Qwen3-Next grouped"; do
        timeout 120 python3 scripts/config_ab.py --shape "$shape" --sizes 1x32768,8x4096 --profile \
          --change out_prefetch=True --change out_prefetch=True,out_warps=8 --change out_warps=8 2>&1 | grep -v Warn \
          | tee -a "$OUT/outload.txt"
      done
      timeout 100 python3 scripts/config_ab.py --shape "GDN fla default" --sizes 1x32768 --profile \
        --change out_stages=2 --change out_stages=3 2>&1 | grep -v Warn | tee -a "$OUT/outload.txt" ;;
    *) echo "unknown section $section: use s4, tests, kernels, kda, analysis, probes, store, dist, attention, rwkv7fix, rwkv7, reduce, table, verify, secular, spectra19, statetile, keysws, aqk, fromv, fromvw, keysfv, outload or devmap" >&2
       exit 2 ;;
  esac
done
