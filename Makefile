# mcp-tasks-proxy — every target installs what it needs (a virtual environment in .venv, the pinned
# conformance suite, the reference server-everything and Node 22 from the npm registry in
# conformance/node_modules; the unit tests start server-everything too).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# `make run` needs only the proxy's runtime dependencies and the example server's SDK (the `example` extra), not
# the dev tools: a stamp of its own. After `make install` the environment has both (a superset), so run uses it.
RUN_STAMP := $(VENV)/.installed-run
DOCS_STAMP := $(VENV)/.installed-docs
RUN_DIR := .run
ANCHOR_STAMP := .venv-anchor/.installed
SUITE := conformance/node_modules/@modelcontextprotocol/conformance/dist/index.js
UPSTREAM_PORT ?= 9000
PORT ?= 8080

.PHONY: install run test unit rules docs conformance bench check lint typecheck format clean docker image-test

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

$(SUITE): conformance/package.json conformance/package-lock.json
	cd conformance && npm ci --no-audit --no-fund --loglevel=error
	touch $(SUITE)

$(DOCS_STAMP): pyproject.toml
	@echo "make docs: installing the proxy and its docs extra (mkdocs-material) into $(VENV) (once; make install adds the dev tools)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --progress-bar on -e ".[docs]"
	touch $(DOCS_STAMP)

$(RUN_STAMP): pyproject.toml
	@echo "make run: installing the runtime dependencies into $(VENV) (once; make install adds the dev tools)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --progress-bar on -e ".[example]"
	touch $(RUN_STAMP)

## run: the proxy on :$(PORT) in front of the bundled example legacy server on :$(UPSTREAM_PORT); its task
## database and key live in $(RUN_DIR)/ (ignored by git and docker)
run: $(if $(wildcard $(STAMP)),$(STAMP),$(RUN_STAMP))
	@mkdir -p $(RUN_DIR)
	@$(BIN)/python -m tests.upstream --host 127.0.0.1 --port $(UPSTREAM_PORT) > /dev/null & \
	  upstream=$$!; trap 'kill $$upstream 2>/dev/null' EXIT INT TERM; \
	  $(BIN)/python -m proxy serve --config config/proxy.example.yaml --db $(RUN_DIR)/mcp-tasks-proxy.db \
	    --upstream http://127.0.0.1:$(UPSTREAM_PORT)/mcp --port $(PORT)

## test: unit + flow tests, the Prometheus rule tests (when promtool is installed), the docs site, then the
## conformance gates
test: unit rules docs conformance

unit: $(STAMP) $(SUITE)
	$(BIN)/python -m pytest -q

## rules: `promtool test rules` on config/monitoring/ (promtool is Debian's `prometheus` package; skipped without it)
rules:
	@if command -v promtool > /dev/null; then \
	  promtool check rules config/monitoring/rules.yaml && \
	  cd config/monitoring && promtool test rules rules.test.yaml; \
	else \
	  echo "rules: promtool not found, Prometheus rule tests SKIPPED (apt-get install prometheus)"; \
	fi

## docs: the documentation site from docs/ into site/ (mkdocs-material); warnings are errors, so a broken link
## or anchor, or a config key without a description, fails it. The references are written from this tree's code.
## It needs the proxy and the `docs` extra only: it installs them (and says so) unless `make install` ran.
docs: $(if $(wildcard $(STAMP)),$(STAMP),$(DOCS_STAMP))
	PYTHONPATH=$(CURDIR) NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

conformance: $(STAMP) $(SUITE)
	$(BIN)/python conformance/run.py

## bench: the benchmark table (ratios against baselines measured in the same run), also benchmarks/results/latest.json
bench: $(STAMP) $(ANCHOR_STAMP)
	$(BIN)/python -m benchmarks.run

# The task rows' anchor, FastMCP + fastmcp-tasks, in an environment of its own (it needs the mcp 2.x SDK).
$(ANCHOR_STAMP): benchmarks/anchor-requirements.txt
	$(PYTHON) -m venv .venv-anchor
	.venv-anchor/bin/pip install --quiet -r benchmarks/anchor-requirements.txt
	touch $(ANCHOR_STAMP)

## check: lint, format check, types, tests
check: lint typecheck test

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) $(RUN_DIR) .venv-anchor conformance/node_modules conformance/out .mypy_cache .ruff_cache .pytest_cache image/wheels build/image site

## docker: the container image, tagged mcp-tasks-proxy:<version from pyproject.toml> and :latest
VERSION = $(shell sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml)

## The Dockerfile needs BuildKit (a RUN --mount): docker with its buildx plugin, else podman (which has it built in).
docker:
	@test -n "$(VERSION)" || { echo "make docker: no version = \"...\" line found in pyproject.toml" >&2; exit 1; }
	@if command -v docker > /dev/null 2>&1 && docker buildx version > /dev/null 2>&1; then \
	  echo "docker build -t mcp-tasks-proxy:$(VERSION) -t mcp-tasks-proxy:latest ."; \
	  docker build -t mcp-tasks-proxy:$(VERSION) -t mcp-tasks-proxy:latest .; \
	elif command -v podman > /dev/null 2>&1; then \
	  echo "podman build --format docker -t mcp-tasks-proxy:$(VERSION) -t mcp-tasks-proxy:latest ."; \
	  podman build --format docker -t mcp-tasks-proxy:$(VERSION) -t mcp-tasks-proxy:latest .; \
	elif command -v docker > /dev/null 2>&1; then \
	  echo "make docker: this docker has no BuildKit (the buildx plugin), which the Dockerfile needs: install it (Debian: apt-get install docker-buildx; docs.docker.com/go/buildx), or podman (apt-get install podman)" >&2; exit 1; \
	else \
	  echo "make docker: neither docker (with BuildKit) nor podman is installed: install one (docs.docker.com/get-docker; Debian: apt-get install podman)" >&2; exit 1; \
	fi

## image-test: build the Dockerfile with podman and run the image for real (slow: not part of `make test`).
## Installs podman, runc and mmdebstrap from Debian when missing, makes the base image locally (no registry),
## builds the proxy's wheels on the host, then smoke-tests the image; prints the build time, image size,
## time to ready and idle RSS. REBUILD_BASE=1 makes the base image again.
image-test: $(STAMP)
	PYTHON=$(abspath $(BIN)/python) image/build.sh
	$(BIN)/python -m tests.image_smoke
