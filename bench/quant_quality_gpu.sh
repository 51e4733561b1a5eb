#!/usr/bin/env bash
# INT4 g128 quality of SmolLM2 with end-to-end tuning on one GPU: quantization-aware training of
# the codes (or scales-only distillation), one run or several side by side, each its own
# `bench/quant_quality.py --device cuda --methods ...` run (processes sharing the GPU), all
# starting from one base checkpoint made first; JSON and logs under OUT_DIR.
#
#   bash bench/quant_quality_gpu.sh OUT_DIR EVAL_FILE
#
# EVAL_FILE: the held-out text of the CPU table (pydoc_data.topics of Python 3.11.7, written by
# `python bench/quant_quality.py --write-eval-text FILE` on that interpreter), since the topics
# differ between Python versions.
#
# The base: AWQ + autoround on the calibration file plus 64 sampled sequences (the
# awq-autoround-gen row of the CPU table), written once by `tandem quantize --device cuda` into
# $BASE_DIR (default build/qbase/awq-autoround-gen, kept if it is there already) and reused by every
# run (`--checkpoint`). Each run then distills from the float model end to end on the calibration
# file plus $E2E_GENERATED sequences sampled from it (16 held out for early stopping), batch 8,
# cosine learning-rate decay over $E2E_STEPS steps or $E2E_MAX_SECONDS, whichever ends first
# (defaults 100000 and 230 s: the clock);
# matrix products in TF32 unless E2E_TF32=0. The decode pass scores $DECODE_WINDOWS windows (the
# CPU table's 8 are the first 8 of them; each row also reports its ratio over those), $EVAL_BATCH
# windows at a time (one token per forward made a 16-window decode pass take ~43 s a row on the
# H200, and two runs on 2026-12-01 ran out of time there). Each run's checkpoints stay in
# $KEEP_DIR/NAME (default build/qat/NAME), so a run stopped in its evaluation can be evaluated
# again with --checkpoint.
set -u
out=${1:?OUT_DIR}
eval_file=${2:?EVAL_FILE}
mkdir -p "$out"
base=${BASE_DIR:-build/qbase/awq-autoround-gen}
if [ ! -f "$base/quantization.json" ]; then
  t0=$(date +%s)
  PYTHONUNBUFFERED=1 python -m tandem.cli quantize --method awq-autoround --calib-generated 64 \
    --device cuda --out "$base" > "$out/base.log" 2>&1 || { echo "base: failed"; exit 1; }
  echo "base: written in $(( $(date +%s) - t0 ))s"
fi
tf32=(); [ "${E2E_TF32:-1}" = 1 ] && tf32=(--e2e-tf32)
common=(--device cuda --eval-file "$eval_file" --e2e-steps "${E2E_STEPS:-100000}" --e2e-batch 8
        --e2e-generated "${E2E_GENERATED:-6144}" --e2e-val-seqs 16 --e2e-eval-every 100
        --e2e-lr 3e-4 --e2e-cosine --e2e-max-seconds "${E2E_MAX_SECONDS:-230}" "${tf32[@]}"
        --decode-windows "${DECODE_WINDOWS:-32}" --eval-batch "${EVAL_BATCH:-16}"
        --checkpoint "awq-autoround-gen=$base")
run() {
  local name=$1; shift
  PYTHONUNBUFFERED=1 timeout "${RUN_TIMEOUT:-560}" python bench/quant_quality.py "${common[@]}" \
    "$@" --keep "${KEEP_DIR:-build/qat}/$name" --out "$out/quant_quality_$name.json" \
    > "$out/$name.log" 2>&1
  echo "$name: exit $?"
}
# RUNS: which runs, side by side: e2e_scales (scales and zero points only), qat_LR (codes too,
# their latents at learning rate LR) and qat2_LR (QAT again, a fresh schedule, from the QAT
# checkpoint in $QAT_FROM, e.g. build/qat/qat_1e-2/awq-autoround-gen-qat of an earlier call: a
# call is at most 10 minutes, and the held-out KL can still be falling at its end).
# Default qat_5e-3 alone (2026-12-02: 1.0409 / 1.0436 on the eval text): with each
# training step one CUDA graph replay, one run makes ~16 steps/s, so 230 s is ~3700 steps, ~5
# passes over 6144 sampled sequences. At 1e-2 for that many steps (and 2048 sequences) the
# held-out KL rose after step 300 (run 1 of bench/results/quant_quality_h200_qat.json); on
# 2026-12-01, eager steps, 2e-2 diverged (held-out KL 0.105 -> 0.25).
for name in ${RUNS:-qat_5e-3}; do
  case $name in
    e2e_scales) run "$name" --methods awq-autoround-gen,awq-autoround-gen-e2e & ;;
    qat_*) run "$name" --methods awq-autoround-gen,awq-autoround-gen-qat \
             --e2e-codes-lr "${name#qat_}" & ;;
    qat2_*) [ -f "${QAT_FROM:-}/quantization.json" ] || { echo "$name needs QAT_FROM" >&2; exit 2; }
            run "$name" --methods awq-autoround-gen,awq-autoround-gen-qat,awq-autoround-gen-qat-qat \
              --checkpoint "awq-autoround-gen-qat=$QAT_FROM" --e2e-codes-lr "${name#qat2_}" & ;;
    *) echo "unknown run $name (e2e_scales, qat_LR or qat2_LR)" >&2; exit 2 ;;
  esac
done
wait
