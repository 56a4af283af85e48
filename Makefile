# One-command entry points. See README.md.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: install run test test-fast lint docs demo bench score score-quick backend clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,plan]'
	touch $@

install: $(VENV)/.installed

backend: install          ## build/fetch llama-server and the model (cached outside the repo)
	$(PY) -m gateway.dev.localbackend ensure

run: backend              ## llama-server (-c 2048 --metrics) on :8080 and the gateway on :8000
	$(PY) -m gateway.dev.localbackend run --config config.example.toml

test: backend             ## the whole suite, real-backend tests included
	$(PY) -m pytest

test-fast: install        ## everything but the real-backend tests
	$(PY) -m pytest -m "not llama"

lint: install             ## ruff over the code and tests, mypy over the code
	$(VENV)/bin/ruff check gateway tests bench scripts
	$(VENV)/bin/mypy

docs: install             ## the documentation site (docs/, mkdocs.yml), built strictly into site/
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(VENV)/bin/mkdocs build --strict --site-dir site

demo: backend             ## the shared-KV overflow, straight vs through the gateway
	$(PY) scripts/demo.py

bench: install            ## gateway vs the bare-proxy floor: JSON, SSE, then 2,000 open streams
	$(PY) bench/bench.py
	$(PY) bench/streams.py

score: backend            ## the scoreboard: every headline promise, side by side (about 30 min)
	$(PY) bench/scoreboard.py --write-docs

score-quick: backend      ## one cell of each scoreboard row, once (a few minutes)
	$(PY) bench/scoreboard.py --quick

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
