# Two entry points on a fresh machine:
#   make demo  - venv + install + pull smollm2:135m + answer one prompt, streamed
#   make test  - venv + install test extras + the test model + the whole suite
# and while working: make test-fast - the unit and kernel tests but the slow ones (< 2 min)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export DYNALM_HOME ?= $(CURDIR)/.models
export DYNALM_CACHE ?= $(CURDIR)/.cache/dynalm
TEST_MODEL := $(DYNALM_HOME)/models/smollm2/135m/SmolLM2-135M-Instruct.Q4_1.gguf
PROMPT ?= Why is the sky blue? Answer in two sentences.

.PHONY: install install-test demo test test-fast lint clean browser cross

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet -e .

install-test: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'

$(TEST_MODEL): | install
	$(BIN)/dynalm pull smollm2:135m

demo: install $(TEST_MODEL)
	$(BIN)/dynalm run smollm2:135m "$(PROMPT)" --verbose

lint: install-test
	$(BIN)/ruff check src tests benchmarks

# The chat page test drives Debian's chromium; as root it is installed here, otherwise
# that test is skipped and says how to install it.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			chromium chromium-driver >/dev/null; \
	else \
		echo "note: not root, so the chat page test will be skipped; to run it:" \
			"sudo apt-get update && sudo apt-get install -y chromium chromium-driver"; \
	fi

# The AArch64 kernel tests cross-compile with gcc-aarch64-linux-gnu and run under qemu-user;
# as root they are installed here, otherwise those tests are skipped and say how to install.
cross:
	@if command -v qemu-aarch64 >/dev/null && command -v aarch64-linux-gnu-gcc >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			qemu-user gcc-aarch64-linux-gnu >/dev/null; \
	else \
		echo "note: not root, so the AArch64 (qemu) kernel tests will be skipped; to run them:" \
			"sudo apt-get update && sudo apt-get install -y qemu-user gcc-aarch64-linux-gnu"; \
	fi

# Two pytest-xdist workers, a test file each at a time (--dist loadfile: a module's model and
# server fixtures are set up once): a lone pytest keeps about one core busy, as much of a test
# is Python, a subprocess or a server round trip. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: install-test $(TEST_MODEL) lint browser cross
	DYNALM_TEST_MODEL=$(TEST_MODEL) $(BIN)/pytest tests -n $(TEST_WORKERS) --dist loadfile --durations=25

test-fast: install-test
	$(BIN)/pytest tests/unit tests/kernels -m "not slow"

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache
