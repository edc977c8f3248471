# Two commands a newcomer needs: `make demo` and `make test`. Both set everything up first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
SETUP_INPUTS := pyproject.toml constraints.txt scripts/install_horovod.sh scripts/apt_programs.sh scripts/install_sshd.sh \
	scripts/install_service_packages.sh scripts/install_image_tools.sh scripts/install_strace.sh \
	package.json package-lock.json tests/training/torchvision_resnet.py Makefile

.PHONY: setup demo image azurite service azure-config azure-up azure-down test test-quick reliability lint bench clean

IAC_TOOLS := .tools/iac
CHECKOV_VERSION := 3.3.30

setup: $(STAMP)

# Idempotent: every step below is a no-op when already satisfied; the stamp only saves the
# few seconds of asking pip and npm again when nothing they read has changed.
$(STAMP): $(SETUP_INPUTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	@# torch first, pinned: any looser spec pulls a multi-GB CUDA build (docs/testing.md).
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	bash scripts/install_horovod.sh $(PY)
	@# torchvision's resnet.py, the ground truth of the ResNet tests: fetched here, never by a test.
	$(PY) -m tests.training.torchvision_resnet
	@# sshd for the emulated Batch nodes of the multi-node tests (root only; see the script).
	bash scripts/install_sshd.sh
	@# PostgreSQL for `make service` and Chromium for its UI tests (root only; see the script).
	bash scripts/install_service_packages.sh
	@# buildah, debootstrap and docker-registry for the training image (root only; see the script).
	bash scripts/install_image_tools.sh
	@# strace holds a checkpoint write's fsync in the mid-write kill test (root only).
	bash scripts/install_strace.sh
	npm ci --no-audit --no-fund --loglevel=error
	@# checkov (the IaC scanner of tests/infra/) in a venv of its own: its pins stay out of ours.
	@test -x $(IAC_TOOLS)/bin/checkov || { $(PYTHON) -m venv $(IAC_TOOLS) && \
		$(IAC_TOOLS)/bin/python -m pip install --quiet checkov==$(CHECKOV_VERSION); }
	@touch $@

demo: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) scripts/demo.py $(DEMO_ARGS)

# The training image's cpu variant (docker/Dockerfile), built with buildah and pushed to the local
# registry; nothing is built when the registry has its tag already (docs/image.md).
image: setup
	$(PY) scripts/image.py

# The local target's Blob storage for the deployments (docs/service.md):
# Azurite on its default port 127.0.0.1:10000 with the demo's dataset uploaded, in the
# foreground until Ctrl-C. AZURITE_ARGS: e.g. --port 10001.
azurite: setup
	$(PY) scripts/demo.py --serve-storage $(AZURITE_ARGS)

# The whole local service in one command (docs/service.md): Azurite, PostgreSQL,
# a Prefect server on it, the work pool and deployments, a worker, the relay and the outputs
# gateway, each started once the one before is healthy; data and logs in .service/; Ctrl-C
# stops them all. SERVICE_ARGS: e.g. --config configs/azure.yaml (python -m deployments.service
# --help).
service: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m deployments.service $(SERVICE_ARGS)

# configs/azure.yaml to fill in (docs/azure.md), from the example; an existing one is kept.
azure-config:
	@if [ -e configs/azure.yaml ]; then \
		echo "configs/azure.yaml exists: left as it is (remove it to start again from configs/azure.example.yaml)" >&2; \
		exit 1; \
	fi
	@cp -n configs/azure.example.yaml configs/azure.yaml
	@echo "configs/azure.yaml created from configs/azure.example.yaml: fill in your names (docs/azure.md)"

# The Azure setup from an empty subscription (docs/azure.md): previews infra/main.json, asks,
# deploys, builds the images, writes configs/azure.yaml, registers the deployments. AZURE_ARGS:
# --subscription ID --location REGION --name-prefix NAME and the rest of
# `python -m cli.azure up --help`. azure-down names what it deletes and asks; data is kept.
azure-up: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m cli.azure up $(AZURE_ARGS)

azure-down: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m cli.azure down $(AZURE_ARGS)

# Everything but the extra trials of the fault tests (marked slow; `make reliability` runs them),
# in TEST_WORKERS processes (pytest-xdist), a test file per process at a time, the longest
# files first (tests/durations.py; refresh its table from .work/junit.xml). Many tests wait
# on servers, launchers and nodes part of the time, so three processes keep two cores busy
# (docs/testing.md).
TEST_WORKERS ?= 3
test: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -m "not slow and not gpu" \
		-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --junitxml=.work/junit.xml \
		--durations=20 $(PYTEST_ARGS)

# The unit tests of every package: the edit-test loop's command. A unit test starts no process
# and no server, itself or through a fixture: tests/conftest.py fails one that does, naming the
# marker it needs (processes), so this target never builds, serves or launches anything.
test-quick: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -m "quick and not slow and not gpu" $(PYTEST_ARGS)

# The reliability suite (tests/reliability/) with more trials, and every test marked slow
# wherever it is (the repeats `make test` leaves out: a second engine, a second database, more
# cases of one scenario; docs/testing.md); it writes docs/reliability.md.
RELIABILITY_TRIALS ?= 5
reliability: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" RETRAIN_RELIABILITY_TRIALS=$(RELIABILITY_TRIALS) \
	RETRAIN_RELIABILITY_REPORT=$(CURDIR)/docs/reliability.md \
	$(PY) -m pytest -m "(reliability or slow) and not gpu" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Every benchmark, side by side on this machine; writes docs/performance.md (about 10 min).
bench: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) node_modules .demo .pytest_cache .ruff_cache .mypy_cache
