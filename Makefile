# Every target creates .venv and installs the pinned packages first, once per change of the
# requirement files, so a fresh clone needs nothing but python3 and make.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvtier-installed

.PHONY: demo test lint bench e2e clean

$(STAMP): pyproject.toml requirements/base.txt requirements/dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/dev.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

demo: $(STAMP)
	$(VENV)/bin/kvtier demo

test: $(STAMP)
	$(PY) -m pytest tests

# mypy must see the installed package layout (agent/ is kvtier.agent, ...): lay it out with
# symlinks under .scratch and check the package from there.
TYPECHECK := .scratch/typecheck
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/kvtier
	ln -s $(CURDIR)/kvtier/*.py $(TYPECHECK)/kvtier/
	ln -s $(CURDIR)/agent $(TYPECHECK)/kvtier/agent
	ln -s $(CURDIR)/bench $(TYPECHECK)/kvtier/bench
	ln -s $(CURDIR)/operator $(TYPECHECK)/kvtier/operator
	MYPYPATH=$(TYPECHECK) $(VENV)/bin/mypy -p kvtier

bench: $(STAMP)
	$(VENV)/bin/kvtier bench host

clean:
	rm -rf $(VENV) .scratch build *.egg-info
