#!/usr/bin/env bash
# One bounded GPU run of the training pipeline for the default model: the target's own corpus
# (prompts and answers through transformers' batched generate on the GPU), its features, and
# GLIDE, EDD and GLIDE's ablation trained one after the other on the same data; then everything worth keeping packed into
# OUT_DIR as results.tar.xz in pieces of at most 15 MB (results.tar.xz.0, .1, ...), also when a
# stage failed or ran out of time. The kept corpus (CORPUS, default the repository's
# corpus/de7dc0073f16aefd) is unpacked into WORK first and continued, and packed again into the
# results (corpus/: its xz files and manifest, to copy over CORPUS).
#
# Knobs (environment): DEADLINE (seconds from the start by which the checkpoints are exported),
# EDD_SECONDS (what EDD gets after GLIDE, features included, 180; 0: none), GLIDE_TRAIN (1; 0: the
# GLIDE stage makes the data alone, and EDD gets the time GLIDE would have), VANILLA_SECONDS (what
# the ablation gets at the end, 150; 0: none),
# DATA_MIN (minutes of data generation), BATCH (sequences per generate call), INSTRUCTIONS,
# LOCAL_TASKS, ANSWER_TOKENS, STEPS, TOKENS_PER_BATCH, FEATURE_GB, MODEL (default: the default model).
set -uo pipefail
out=${OUT_DIR:-${OUT:-/tmp/specdraft-out}}
work=${WORK:-/tmp/specdraft-train}
py=${PY:-python3}
device=${DEVICE:-cuda}
deadline=${DEADLINE:-480}
started=$(date +%s)
mkdir -p "$out" "$work/out" "$work/logs"
log=$work/logs
common=(${MODEL:+--model "$MODEL"} --device "$device" --backend hf --dtype float32 --work "$work/data"
  --instructions "${INSTRUCTIONS:-16000}" --local-tasks "${LOCAL_TASKS:-4000}"
  --max-answer-tokens "${ANSWER_TOKENS:-320}" --generate-batch "${BATCH:-2048}"
  --max-feature-gb "${FEATURE_GB:-10}" --steps "${STEPS:-2000}"
  --tokens-per-batch "${TOKENS_PER_BATCH:-8192}" --quiet)
left() { echo $((deadline - ($(date +%s) - started))); }
minutes_left() { "$py" -c "print(max(0.5, $(left) / 60))"; }

corpus=${CORPUS-corpus/de7dc0073f16aefd}
if [ -n "$corpus" ] && [ -f "$corpus/manifest.json" ]; then
  "$py" -m client.cli train corpus unpack --corpus "$corpus" --work "$work/data" >"$log/unpack.json" 2>&1
fi

{ nvidia-smi -L; "$py" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'; } >"$log/env.txt" 2>&1

# GLIDE: data, features, then training until EDD_SECONDS + VANILLA_SECONDS before the deadline
# (less the export); then EDD on the same answers (its own features) until VANILLA_SECONDS before
# it; then the ablation on GLIDE's features until the deadline. One after the other: side by side
# each ran five times slower (the first run's log).
edd_seconds=${EDD_SECONDS:-180}
vanilla_seconds=${VANILLA_SECONDS:-150}
glide_only=()
if [ "${GLIDE_TRAIN:-1}" = 0 ]; then glide_only=(--data-only); fi
timeout -k 20 "$(($(left) + 30))" "$py" -m client.cli train glide "${common[@]}" --out "$work/out/glide" \
  --data-minutes "${DATA_MIN:-3.5}" "${glide_only[@]}" \
  --finish-minutes "$("$py" -c "print(max(0.5, ($(left) - $edd_seconds - $vanilla_seconds) / 60))")" \
  >"$log/glide.json" 2>"$log/glide.err"
echo "glide exit $?" >>"$log/exits.txt"
if [ "$edd_seconds" -gt 0 ] && [ "$(left)" -gt 60 ]; then
  timeout -k 20 "$(($(left) + 30))" "$py" -m client.cli train edd "${common[@]}" \
    --out "$work/out/edd" --data-minutes 0.001 \
    --finish-minutes "$("$py" -c "print(max(0.5, ($(left) - $vanilla_seconds) / 60))")" \
    >"$log/edd.json" 2>"$log/edd.err"
  echo "edd exit $?" >>"$log/exits.txt"
fi
if [ "$vanilla_seconds" -gt 0 ] && [ "$(left)" -gt 60 ]; then
  timeout -k 20 "$(($(left) + 30))" "$py" -m client.cli train glide "${common[@]}" --vanilla \
    --out "$work/out/glide-vanilla" --data-minutes 0.001 --finish-minutes "$(minutes_left)" \
    >"$log/glide-vanilla.json" 2>"$log/glide-vanilla.err"
  echo "glide-vanilla exit $?" >>"$log/exits.txt"
fi
echo "seconds $(($(date +%s) - started))" >>"$log/exits.txt"

# Pack: the corpus (prompts and answers, as the repository keeps it), the checkpoints, the reports
# and logs.
if [ -n "$corpus" ] && [ -f "$corpus/manifest.json" ]; then cp -r "$corpus" "$work/corpus"; fi
"$py" -m client.cli train corpus pack --work "$work/data" --corpus "$work/corpus" \
  --note "scripts/gpu/train.sh on $(nvidia-smi -L 2>/dev/null | head -1 | cut -d'(' -f1)" >"$log/pack.json" 2>&1
cd "$work"
files=(logs corpus)
for f in data/heldout-questions.jsonl out/{glide,edd,glide-vanilla}.{json,safetensors}; do
  [ -f "$f" ] && files+=("$f")
done
for d in data/features-*; do [ -f "$d/manifest.json" ] && files+=("$d/manifest.json"); done
if command -v xz >/dev/null; then
  tar -cf - "${files[@]}" | xz -T0 -6 >"$out/results.tar.xz"
else
  "$py" -c 'import sys, tarfile
with tarfile.open(sys.argv[1], "w:xz") as t:
    [t.add(f) for f in sys.argv[2:]]' "$out/results.tar.xz" "${files[@]}"
fi
split -b 15M -d -a 1 "$out/results.tar.xz" "$out/results.tar.xz."
rm "$out/results.tar.xz"
ls -la "$out"
cat "$log/exits.txt"
