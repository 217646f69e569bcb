# trainwarden: two commands on a fresh machine.
#   make demo   creates .venv, installs trainwarden, runs the 3D-parallel CPU demo with a fault injected
#   make test   creates .venv if needed, installs the test extra and the system packages, runs the suite
#   make gpu-check  on a machine with an NVIDIA GPU: the GPU-only tests and benchmarks, figures in runs/gpu-check.json
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, pinned to a CPU build, so pip does not pull a multi-GB CUDA build for the dependency range
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
DEMO_FAULTS ?= crash:rank=5,step=16;slow:rank=6,from=22,until=38,factor=2;nan:rank=7,step=45
DEMO_STEPS ?= 70

.PHONY: demo demo-cluster dashboard-pictures test test-all gpu-check venv install install-test system-packages bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

venv: $(BIN)/python
install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# Prometheus, Alertmanager and promtool for the integration tests, and Chromium that opens `trainwarden report`'s
# page (Debian packages).
system-packages:
	@if ! command -v promtool >/dev/null || ! command -v prometheus-alertmanager >/dev/null \
	    || ! command -v chromium >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      prometheus prometheus-alertmanager chromium >/dev/null; \
	  else \
	    echo "make test: prometheus/promtool/chromium missing and not root; their tests will be skipped" >&2; \
	  fi; \
	fi

demo: $(VENV)/.installed
	rm -rf runs/jobs/demo
	TRAINWARDEN_STATE_HOME=$(CURDIR)/runs TRAINWARDEN_FAULTS='$(DEMO_FAULTS)' \
	  $(BIN)/trainwarden run --nproc-per-node 8 --max-restarts 2 --job demo -- \
	  -m trainwarden.runtime.examples.gpt --dp 2 --tp 2 --pp 2 --steps $(DEMO_STEPS) --ckpt-every 10

# three simulated nodes (network namespaces; root) and a 3-member etcd cluster; at step 12 node n2 is lost
# (DEMO_CLUSTER_FAULT=kill), partitioned (partition) or its link slowed to 20 Mbit/s both ways (slow-link)
DEMO_CLUSTER_FAULT ?= kill
demo-cluster: $(VENV)/.installed
	$(BIN)/python tests/demo_cluster.py --fault $(DEMO_CLUSTER_FAULT)

# docs/img/dashboard-{job,node}.png: a real Prometheus scrapes a short faulted CPU run, then dashboards/render.py
# draws both Grafana dashboards from its data (about 3 minutes)
dashboard-pictures: $(VENV)/.installed-test system-packages
	$(BIN)/python tests/dashboard_pictures.py --out docs/img

test: $(VENV)/.installed-test system-packages
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# the default suite and the tests marked extended (the longest scenarios, second variants): about 11 minutes more
test-all: $(VENV)/.installed-test system-packages
	$(BIN)/python -m pytest --extended $(PYTEST_ARGS)

# every GPU-only test and benchmark (tests/gpu, marked gpu; skipped in `make test` without a GPU) on this machine's
# GPU, with a CUDA build of torch: NCCL's Flight Recorder, CUDA step timing, NVML against nvidia-smi, warm workers with
# CUDA, the checkpoint stall of a 403M-parameter model, telemetry overhead on a 60 ms step (about 10 minutes). The
# figures go to $(GPU_FIGURES), also when a check fails.
GPU_FIGURES ?= runs/gpu-check.json
gpu-check: $(VENV)/.installed-test
	@$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
	  'make gpu-check: no CUDA GPU visible to torch ' + torch.__version__ + ' (a CUDA build is needed: TORCH_SPEC)')"
	rm -rf runs/gpu-check && mkdir -p runs/gpu-check
	TRAINWARDEN_GPU_FIGURES=$(CURDIR)/runs/gpu-check $(BIN)/python -m pytest -m gpu tests/gpu $(PYTEST_ARGS); \
	  status=$$?; $(BIN)/python tests/gpu/gpu_figures.py runs/gpu-check $(GPU_FIGURES); exit $$status

bench: $(VENV)/.installed-test
	$(BIN)/python tests/bench/bench_checkpoint.py
	$(BIN)/python tests/bench/bench_telemetry.py

clean:
	rm -rf $(VENV) runs build *.egg-info
