# make demo  - install (if needed) and train DLRM on synthetic clicks on 2 CPU processes
# make test  - install (if needed) and run the test suite
# make lint  - ruff
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_ARGS ?=

.PHONY: install demo test lint clean

install: $(STAMP)

# Re-installs only when the pins or the package metadata change; a second `make` is instant.
$(STAMP): pyproject.toml requirements/*.txt scripts/install.sh
	scripts/install.sh $(VENV)
	touch $@

demo: $(STAMP)
	$(PY) -m lightning_torchrec.demo fit $(DEMO_ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check lightning_torchrec tests
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_torchrec tests
	$(VENV)/bin/ruff format --check lightning_torchrec tests

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache
