# make demo  - install (if needed) and train DLRM on synthetic clicks on 2 CPU processes
# make demo-fabric - the same job in a loop of your own, on Lightning Fabric
# make demo-seq - train a SASRec-style sequence recommender on generated MovieLens-layout data
# make demo-online - train a drifting stream of hourly partitions, publish deltas to a served model
# make test  - install (if needed) and run the test suite
# make docs  - build the documentation site (warnings are errors)
# make bench - run the benchmarks (not part of make test)
# make lint  - ruff
# make test-compat - build (if needed) the oldest and newest supported TorchRec stacks and run
#                    the multi-process core tests in each (downloads a few GB; not part of make test)
# make test-cluster - as root on Debian: start munged, slurmctld and slurmd on this host, train
#                     2 ranks under SLURM, requeue mid-epoch, check the exact resume (not in make test)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_ARGS ?=

.PHONY: install demo demo-fabric demo-seq demo-online test docs bench lint clean test-compat test-cluster
LINT_PATHS := lightning_torchrec tests benchmarks notebooks/*.py scripts/*.py docs/conf.py

install: $(STAMP)

# Re-installs only when the pins or the package metadata change; a second `make` is instant.
$(STAMP): pyproject.toml requirements/*.txt scripts/install.sh
	scripts/install.sh $(VENV)
	touch $@

demo: $(STAMP)
	$(PY) -m lightning_torchrec.demo fit $(DEMO_ARGS)

demo-fabric: $(STAMP)
	$(PY) -m lightning_torchrec.demo_fabric $(DEMO_ARGS)

demo-seq: $(STAMP)
	$(PY) -m lightning_torchrec.demo_seq $(DEMO_ARGS)

demo-online: $(STAMP)
	$(PY) -m lightning_torchrec.demo_online $(DEMO_ARGS)

# Two workers, a test file each: a test file's module-scoped launch runs once, on one worker.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

bench: $(STAMP)
	$(PY) -m benchmarks.run

docs: $(STAMP)
	$(VENV)/bin/sphinx-build -E -W --keep-going -b html docs docs/_build/html

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

test-compat:
	scripts/test_compat.sh

test-cluster: $(STAMP)
	PY=$(PY) scripts/test_cluster.sh

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache
