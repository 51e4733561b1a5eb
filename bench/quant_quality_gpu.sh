#!/usr/bin/env bash
# INT4 g128 quality of SmolLM2 with end-to-end tuning on one GPU: scales-only distillation and
# quantization-aware training of the codes at two learning rates, side by side, each its own
# `bench/quant_quality.py --device cuda --methods ...` run (three processes sharing the GPU);
# JSON and logs under OUT_DIR.
#
#   bash bench/quant_quality_gpu.sh OUT_DIR EVAL_FILE
#
# EVAL_FILE: the held-out text of the CPU table (pydoc_data.topics of Python 3.11.7, written by
# `python bench/quant_quality.py --write-eval-text FILE` on that interpreter), since the topics
# differ between Python versions.
#
# Every run: AWQ + autoround on the calibration file plus 64 sampled sequences (the
# awq-autoround-gen base of the CPU table), then end-to-end distillation from the float model on
# the calibration file plus $E2E_GENERATED sequences sampled from it (16 held out for early
# stopping), batch 8, cosine learning-rate decay over $E2E_STEPS steps or $E2E_MAX_SECONDS,
# whichever ends first.
set -u
out=${1:?OUT_DIR}
eval_file=${2:?EVAL_FILE}
mkdir -p "$out"
common=(--device cuda --eval-file "$eval_file" --e2e-steps "${E2E_STEPS:-600}" --e2e-batch 8
        --e2e-generated "${E2E_GENERATED:-2048}" --e2e-val-seqs 16 --e2e-eval-every 100
        --e2e-lr 3e-4 --e2e-cosine --e2e-max-seconds "${E2E_MAX_SECONDS:-230}")
run() {
  local name=$1; shift
  PYTHONUNBUFFERED=1 timeout "${RUN_TIMEOUT:-560}" python bench/quant_quality.py "${common[@]}" \
    "$@" --out "$out/quant_quality_$name.json" > "$out/$name.log" 2>&1
  echo "$name: exit $?"
}
# RUNS: which runs, side by side: e2e_scales (scales and zero points only) and qat_LR (codes too,
# their latents at learning rate LR).
for name in ${RUNS:-e2e_scales qat_3e-3 qat_1e-2}; do
  case $name in
    e2e_scales) run "$name" --methods awq-autoround-gen-e2e & ;;
    qat_*) run "$name" --methods awq-autoround-gen-qat --e2e-codes-lr "${name#qat_}" & ;;
    *) echo "unknown run $name (e2e_scales or qat_LR)" >&2; exit 2 ;;
  esac
done
wait
