#!/usr/bin/env bash
# Here (with the project installed): pack what a bare GPU machine without network needs to run
# the training pipeline on the default model, into DIR (default .gpu, git-ignored):
#   DIR/common/   the gguf wheel (transformers reads GGUF through it), the model's sha256, the
#                 tokenizer files (for the tiny smoke-test model), the piece count
#   DIR/model.partN  the default model's GGUF in PIECES pieces (2 by default: about 49 MB each),
#                 each small enough to travel beside the repository in one call
# On the GPU machine, scripts/gpu/unpack.sh collects the pieces over several calls.
set -euo pipefail
dest=${1:-.gpu}
pieces=${PIECES:-2}
py=${PY:-.venv/bin/python}
gguf=$("$py" -c 'from llm_worker.model.loading import default_gguf_path; print(default_gguf_path())')
model=$("$py" -c 'from llm_worker.model.loading import default_model_dir; print(default_model_dir())')
version=$("$py" -c 'import importlib.metadata as m; print(m.version("gguf"))')
rm -rf "$dest/common" "$dest"/model.part*
mkdir -p "$dest/common"
size=$(stat -c %s "$gguf")
split -b $(((size + pieces - 1) / pieces)) -d -a 1 "$gguf" "$dest/model.part"
sha256sum "$gguf" | cut -d' ' -f1 >"$dest/common/model.sha256"
echo "$pieces" >"$dest/common/pieces"
cp "$model"/tokenizer.json "$model"/tokenizer_config.json "$dest/common/"
[ -f "$model/chat_template.jinja" ] && cp "$model/chat_template.jinja" "$dest/common/"
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$dest/common" "gguf==$version"
ls -la "$dest" "$dest/common"
