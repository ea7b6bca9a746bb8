#!/usr/bin/env bash
# The whole training pipeline on DEVICE (default cuda) with a tiny random Llama and the real
# tokenizer, in a minute: prompts, answers, features, training, export; GLIDE, then EDD on the same data. Run it before a long GPU
# run. Needs DIR/common from scripts/gpu/pack.sh (the tokenizer files).
set -euo pipefail
device=${1:-cuda}
src=${2:-.gpu}
work=${SMOKE_DIR:-/tmp/specdraft-smoke}
py=${PY:-python3}
rm -rf "$work"
mkdir -p "$work/tiny"
"$py" - "$src/common" "$work/tiny" <<'PY'
import sys

import torch
import transformers

tok = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
torch.manual_seed(0)
cfg = transformers.LlamaConfig(
    vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    eos_token_id=tok.eos_token_id, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
)
model = transformers.LlamaForCausalLM(cfg)
model.generation_config.eos_token_id = tok.eos_token_id
model.save_pretrained(sys.argv[2])
tok.save_pretrained(sys.argv[2])
PY
time "$py" -m client.cli train glide --model "$work/tiny" --device "$device" --backend hf \
  --dtype float32 --work "$work/w" --out "$work/out/glide" --instructions 6 --local-tasks 4 \
  --generate-batch 8 --max-answer-tokens 16 --vocab 512 --steps 3 --tokens-per-batch 512 --heldout-fraction 0.5 \
  --data-minutes 2 --quiet >"$work/report.json"
time "$py" -m client.cli train edd --model "$work/tiny" --device "$device" --backend hf \
  --dtype float32 --work "$work/w" --out "$work/out/edd" --instructions 6 --local-tasks 4 \
  --generate-batch 8 --max-answer-tokens 16 --vocab 512 --steps 3 --tokens-per-batch 512 --heldout-fraction 0.5 \
  --data-minutes 2 --quiet >"$work/report-edd.json"
for r in report report-edd; do
  "$py" -c 'import json,sys; r=json.load(open(sys.argv[1])); print("smoke ok:", {k: r[k] for k in ("data_dtype", "answers", "features", "training", "checkpoint")})' "$work/$r.json"
done
