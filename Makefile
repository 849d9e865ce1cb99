# kdtree: `make notebooks` runs every notebook headless, `make test` runs the tests, `make lab` opens them
# interactively. Each creates the virtual environment .venv first when it is missing (or older than pyproject.toml).
#
#   make venv                  .venv with torch (CPU pin below), the project (editable) and its dev extras
#   make test                  pytest (ARGS="-k tree" passes more options)
#   make notebooks             python -m kdtree_lib.notebooks into runs/<time>/ (ARGS="--only 01 --set 01.budget=64")
#   make lab                   JupyterLab (the `notebooks` extra) into .venv once, then started on notebooks/
#                              (ARGS="--no-browser --port 8889")
#   make check-notebooks-clean committed notebooks carry no outputs; `make strip-notebooks` clears them
#   make wheelhouse            offline wheels for a Python 3.12 GPU host without a package index (< 40 MB)
#   make clean                 runs/, wheelhouse/ and caches (`make distclean` also removes .venv)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned: this pin is the CPU wheel on the development machines; anything looser pulls a
# multi-GB CUDA build. On a GPU host keep its own torch: make TORCH=torch
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.kdtree-installed
ARGS ?=

WHEELHOUSE ?= wheelhouse
WHEELHOUSE_MAX_MB ?= 40
# pip evaluates markers such as python_version == "3.12" with the interpreter it runs on, whatever
# --python-version says: so a Python 3.12 does the download and the check where one runs here, and
# aiohttp (papermill's dependency on 3.12 only) is named explicitly for when none does.
WHEEL_PYTHON ?= $(or $(shell PYENV_VERSION=3.12 python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null),$(PYTHON))
WHEELHOUSE_PACKAGES := papermill nbclient nbformat ipykernel ipywidgets jupyter_client aiohttp httpx tornado tiktoken
WHEEL_TARGET := --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
	--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	--platform manylinux2010_x86_64 --platform manylinux1_x86_64

.PHONY: venv setup test notebooks lab check-notebooks-clean strip-notebooks wheelhouse clean distclean

venv setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (kdtree .venv)"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

notebooks: $(STAMP)
	$(PY) -m kdtree_lib.notebooks $(ARGS)

# interactive use (the explorers of notebooks 01 and 13 need a live kernel): JupyterLab joins the same .venv
# and kernel. Jupyter refuses to start as root unless told, and containers run as root.
LAB_UID ?= $(shell id -u)
LAB_ROOT := $(if $(filter 0,$(LAB_UID)),--allow-root)

$(VENV)/bin/jupyter-lab: $(STAMP)
	$(PY) -m pip install --quiet -e ".[notebooks]"

lab: $(VENV)/bin/jupyter-lab
	$(VENV)/bin/jupyter-lab --notebook-dir=notebooks $(LAB_ROOT) $(ARGS)

check-notebooks-clean: $(STAMP)
	$(PY) -m kdtree_lib.notebooks --check-clean

strip-notebooks: $(STAMP)
	$(PY) -m kdtree_lib.notebooks --strip

# Wheels for `pip install --no-index --find-links wheelhouse papermill ipykernel ipywidgets httpx tornado tiktoken` on a
# Python 3.12 x86_64 host that has torch, CuPy, numpy, matplotlib, tqdm and transformers already.
# The resolve check ignores this machine's pip configuration, so it sees only the wheelhouse.
wheelhouse:
	@echo "wheelhouse: downloading with $(WHEEL_PYTHON) ($$($(WHEEL_PYTHON) --version))"
	$(WHEEL_PYTHON) -m pip download --quiet --dest $(WHEELHOUSE) $(WHEEL_TARGET) $(WHEELHOUSE_PACKAGES)
	target=$$(mktemp -d) && env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
		$(WHEEL_PYTHON) -m pip install --dry-run --quiet --ignore-installed --no-index --find-links $(WHEELHOUSE) \
		$(WHEEL_TARGET) --target $$target papermill ipykernel ipywidgets httpx tornado tiktoken && rm -rf $$target
	@size=$$(du -sm $(WHEELHOUSE) | cut -f1); \
	echo "wheelhouse: $$(ls $(WHEELHOUSE) | wc -l) wheels, $$(du -sh $(WHEELHOUSE) | cut -f1) (limit $(WHEELHOUSE_MAX_MB) MB); offline install resolves"; \
	test $$size -lt $(WHEELHOUSE_MAX_MB)

clean:
	rm -rf runs $(WHEELHOUSE) .pytest_cache .hypothesis build *.egg-info
	find . -name __pycache__ -not -path "./$(VENV)/*" -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
