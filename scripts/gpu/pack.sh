#!/usr/bin/env bash
# Here (with the project installed): pack what a bare GPU machine without network needs to run
# the training pipeline or `make gpu-check` on the default model, into DIR (default .gpu,
# git-ignored):
#   DIR/common/   the gguf wheel (transformers reads GGUF through it), the model's sha256, the
#                 tokenizer files (for the tiny smoke-test model), the piece count
#   DIR/wheels/   what `make gpu-check` imports and the GPU image lacks or may hold in another
#                 version: grpcio, protobuf (the generated stubs in specdraft/v1 check both
#                 versions at import), grpcio-health-checking, grpcio-reflection, as installed
#                 here; cp312 manylinux wheels (about 8 MB)
#   DIR/model.partN  the default model's GGUF in PIECES pieces, each small enough to travel beside
#                 the repository's tracked files and DIR/common in one call (64 MiB a call):
#                 PIECES=auto (the default) takes the fewest that fit; the checkpoint calls of
#                 docs/gpu.md take PIECES=2 with the shipped checkpoints out of the index
# On the GPU machine, scripts/gpu/unpack.sh collects the pieces over several calls and installs
# the wheels. Prints the bytes each kind of call carries.
set -euo pipefail
dest=${1:-.gpu}
pieces=${PIECES:-auto}
py=${PY:-.venv/bin/python}
limit=$((64 * 1024 * 1024))
margin=$((1024 * 1024)) # new files not yet tracked, shared/
gguf=$("$py" -c 'from llm_worker.model.loading import default_gguf_path; print(default_gguf_path())')
model=$("$py" -c 'from llm_worker.model.loading import default_model_dir; print(default_model_dir())')
version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf "$dest/common" "$dest/wheels" "$dest"/model.part*
mkdir -p "$dest/common" "$dest/wheels"
cp "$model"/tokenizer.json "$model"/tokenizer_config.json "$dest/common/"
[ -f "$model/chat_template.jinja" ] && cp "$model/chat_template.jinja" "$dest/common/"
sha256sum "$gguf" | cut -d' ' -f1 >"$dest/common/model.sha256"
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$dest/common" "gguf==$(version gguf)"
wheels=()
for package in grpcio protobuf grpcio-health-checking grpcio-reflection; do
  wheels+=("$package==$(version "$package")")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest/wheels" "${wheels[@]}"

[ -d specdraft/v1 ] || "$py" client/build_stubs.py >/dev/null # the gRPC stubs travel too (git-ignored)

tracked=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
common=$(du -sb "$dest/common" | cut -f1)
size=$(stat -c %s "$gguf")
if [ "$pieces" = auto ]; then
  room=$((limit - margin - tracked - common))
  pieces=$(((size + room - 1) / room))
fi
[ "$pieces" -le 10 ] || { echo "pack.sh: $pieces pieces; split names one digit (at most 10)" >&2; exit 1; }
echo "$pieces" >"$dest/common/pieces"
split -b $(((size + pieces - 1) / pieces)) -d -a 1 "$gguf" "$dest/model.part"
piece=$(stat -c %s "$dest/model.part0")
wheels=$(du -sb "$dest/wheels" | cut -f1)
stubs=$(du -sb specdraft/v1 | cut -f1)
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "tracked files $(mib "$tracked"), $dest/common $(mib "$common"), a piece $(mib "$piece") ($pieces pieces)"
echo "a piece call carries $(mib $((tracked + common + piece))); the check call" \
  "$(mib $((tracked + common + wheels + stubs))) ($dest/wheels $(mib "$wheels"), specdraft/v1 $(mib "$stubs"));" \
  "the limit is $(mib $limit)"
