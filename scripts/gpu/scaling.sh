#!/usr/bin/env bash
# Held-out acceptance against training-data size, on a GPU: the committed corpus's features are
# made once per recipe (GLIDE's layer-29 K/V, EDD's layer-26 hidden states; FEATURE_GB each), then
# glide, glide:vanilla=1 and edd are trained on growing prefixes of the same cache (SIZES answer
# tokens) for EPOCHS passes each, and every run's report lands in OUT_DIR/scaling.tar.xz with a
# summary table (scaling.md). Needs the model (scripts/gpu/unpack.sh) like train.sh. Every run
# shares the held-out split and the draft vocabulary (of the whole cache); only the training
# conversations grow.
#
# Knobs (environment): SIZES (answer tokens, "250000 500000 1000000 2000000"), EPOCHS (3),
# FEATURE_GB (6), TOKENS_PER_BATCH (8192), DRAFTERS ("glide glide-vanilla edd"), MODEL, DEVICE,
# CORPUS (corpus/de7dc0073f16aefd), WORK, PY.
set -uo pipefail
out=${OUT_DIR:-${OUT:-/tmp/specdraft-out}}
work=${WORK:-/tmp/specdraft-scaling}
py=${PY:-python3}
device=${DEVICE:-cuda}
batch=${TOKENS_PER_BATCH:-8192}
epochs=${EPOCHS:-3}
mkdir -p "$out" "$work/out" "$work/logs"
corpus=${CORPUS-corpus/de7dc0073f16aefd}
if [ -n "$corpus" ] && [ -f "$corpus/manifest.json" ]; then
  "$py" -m client.cli train corpus unpack --corpus "$corpus" --work "$work/data" >"$work/logs/unpack.json" 2>&1
fi
common=(${MODEL:+--model "$MODEL"} --device "$device" --backend hf --dtype float32 --work "$work/data"
  --data-dtype float32 --instructions 0 --local-tasks 0 --data-minutes 1e-9 --max-feature-gb "${FEATURE_GB:-6}"
  --tokens-per-batch "$batch" --quiet)
for size in ${SIZES:-250000 500000 1000000 2000000}; do
  steps=$(((size * epochs + batch - 1) / batch))
  for drafter in ${DRAFTERS:-glide glide-vanilla edd}; do
    case $drafter in
      glide) args=(train glide) ;;
      glide-vanilla) args=(train glide --vanilla) ;;
      edd) args=(train edd) ;;
    esac
    name=$drafter-$size
    started=$(date +%s)
    "$py" -m client.cli "${args[@]}" "${common[@]}" --train-answer-tokens "$size" --steps "$steps" \
      --out "$work/out/$name" >"$work/logs/$name.json" 2>"$work/logs/$name.err"
    echo "$name exit $? seconds $(($(date +%s) - started))" >>"$work/logs/exits.txt"
  done
done
"$py" - "$work/logs" >"$work/logs/scaling.md" <<'PY'
import json, pathlib, sys
rows = []
for path in sorted(pathlib.Path(sys.argv[1]).glob("*-*.json")):
    try:
        t = json.loads(path.read_text())["training"]
    except (ValueError, KeyError):
        continue
    acc = t["heldout_top1_by_depth"][:5]
    rows.append((path.stem, t["train_answer_tokens"], t["steps"], acc, sum(acc) / len(acc), t["heldout_positions"]))
print("| run | answer tokens | steps | top-1 by depth 1..5 | mean | held-out positions |")
print("|---|---|---|---|---|---|")
for name, tokens, steps, acc, mean, positions in sorted(rows, key=lambda r: (r[0].rsplit("-", 1)[0], r[1])):
    print(f"| {name} | {tokens} | {steps} | {' / '.join(f'{a:.3f}' for a in acc)} | {mean:.3f} | {positions} |")
PY
cat "$work/logs/scaling.md"
cd "$work" && tar -cJf "$out/scaling.tar.xz" logs
ls -la "$out"
