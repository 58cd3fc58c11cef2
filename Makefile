# pdeformer: the two commands are `make run` and `make test`; each sets up what is missing.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 2
CONFIG ?= runs/default.toml
PYTEST_ARGS ?=
# test processes (pytest-xdist); 1 runs the suite in this process. Tests that start
# `mpirun -n 2` share the cores with the other worker, so more than the cores gains nothing.
TEST_WORKERS ?= 2
# Open MPI refuses root and more ranks than cores unless told; other MPIs get no flags.
MPIRUN = mpirun $(shell mpirun --version 2>/dev/null | grep -q "Open MPI" && echo "--oversubscribe $$([ $$(id -u) = 0 ] && echo --allow-run-as-root)")

STUDIES ?= mesh degree layers heads heads_law heads_bias particles

.PHONY: setup run forward test test-slow test-slurm verification training-studies pictures docs reference clean help

help:
	@echo "make setup      install what is missing (Debian packages, .venv, pdeformer)"
	@echo "make run        a short training of $(CONFIG) under mpirun -n $(NP)"
	@echo "make forward    the forward pass of $(CONFIG) under mpirun -n $(NP)"
	@echo "make test       the test suite (serial and mpirun -n 2 cases; TEST_WORKERS=2 processes)"
	@echo "make test-slow  the slow convergence studies"
	@echo "make test-slurm runs/slurm.sh under a one-node SLURM set up here (root; not in make test)"
	@echo "make verification  the convergence studies and the error budget -> docs/verification/ (about 45 min)"
	@echo "make training-studies  the teacher-student and SGD studies -> docs/training/ (about 1 h)"
	@echo "make pictures   forward and train $(CONFIG), refresh the README's pictures in docs/pictures/"
	@echo "make docs       the documentation as HTML -> docs/_build/html (Sphinx; warnings are errors)"
	@echo "make reference  regenerate docs/reference/ (configuration, CLI, output files, API) from the code"

setup:
	@bash .ci/bootstrap.sh

run: setup
	$(MPIRUN) -n $(NP) $(VENV)/bin/pdeformer train $(CONFIG)

forward: setup
	$(MPIRUN) -n $(NP) $(VENV)/bin/pdeformer forward $(CONFIG)

test: setup
	$(PY) -m pytest $(shell [ "$(TEST_WORKERS)" -gt 1 ] 2>/dev/null && $(PY) -c "import xdist" 2>/dev/null && echo "-n $(TEST_WORKERS) --dist loadgroup") $(PYTEST_ARGS)

test-slow: setup
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

test-slurm: setup
	@bash .ci/test-slurm.sh

verification: setup
	@mkdir -p docs/verification
	@for s in $(STUDIES); do \
	  $(MPIRUN) -n $(NP) $(VENV)/bin/pdeformer converge runs/studies/$$s.toml -q \
	    $$(grep -q "^seeds" runs/studies/$$s.toml && echo --set study.groups=$(NP)) || exit 1; \
	  cp runs/studies/output/$$s/convergence.md docs/verification/$$s.md; \
	  cp runs/studies/output/$$s/convergence.png docs/verification/$$s.png; \
	done
	$(MPIRUN) -n $(NP) $(VENV)/bin/pdeformer budget runs/studies/budget.toml -q --set budget.groups=$(NP)
	cp runs/studies/output/budget/budget.md docs/verification/budget.md
	cp runs/studies/output/budget/budget.png docs/verification/budget.png

training-studies: setup
	$(PY) runs/studies/training.py all --np $(NP)

# the README's pictures: what `make forward` and `make run` draw, and a ParaView screenshot
PICTURES_RUNS ?= runs/output/pictures
pictures: setup
	@command -v pvbatch >/dev/null && command -v xvfb-run >/dev/null || \
	  { echo "make pictures: needs ParaView and Xvfb (Debian: apt-get install paraview xvfb)"; exit 1; }
	@mkdir -p docs/pictures
	$(MPIRUN) -n $(NP) $(VENV)/bin/pdeformer forward $(CONFIG) -q --set output.dir=$(PICTURES_RUNS)/forward
	$(MPIRUN) -n $(NP) $(VENV)/bin/pdeformer train $(CONFIG) -q --set output.dir=$(PICTURES_RUNS)/train
	for p in densities diagnostics; do cp $(PICTURES_RUNS)/forward/$$p.png docs/pictures/forward-$$p.png; done
	for p in densities training heads; do cp $(PICTURES_RUNS)/train/$$p.png docs/pictures/train-$$p.png; done
	cd $(PICTURES_RUNS)/forward && xvfb-run -a -s "-screen 0 1280x1024x24" pvbatch paraview.py \
	  --time 0.5 --screenshot $(CURDIR)/docs/pictures/forward-paraview.png

# the documentation: Debian's Sphinx and MyST (installed where missing, as root), run by
# the venv's Python so that autodoc imports this checkout's pdeformer
DOCS_PACKAGES := python3-sphinx python3-myst-parser
docs: setup
	@$(PY) -c "import sphinx, myst_parser" 2>/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(DOCS_PACKAGES) >/dev/null; \
	  fi; \
	  $(PY) -c "import sphinx, myst_parser" 2>/dev/null || \
	    { echo "make docs: needs Sphinx and MyST for $(PY) (Debian, as root: apt-get install $(DOCS_PACKAGES))"; exit 1; }; }
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html
	@echo "docs/_build/html/index.html"

reference: setup
	$(PY) docs/reference/generate.py

clean:
	rm -rf runs/output output .pytest_cache
