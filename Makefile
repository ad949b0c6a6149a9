# Two entry points (see README): `make demo` and `make test`. Both install missing Debian
# packages, configure and build with CMake (with the Python module, for Debian's
# /usr/bin/python3: python/CMakeLists.txt).
BUILD_DIR ?= build
ASAN_BUILD_DIR ?= build-asan
TSAN_BUILD_DIR ?= build-tsan
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
WERROR := $(if $(CI),-DKVFERRY_WERROR=ON,)

.PHONY: deps configure build build-cli build-asan build-tsan demo test test-asan test-tsan fuzz soak clean

deps:
	@scripts/install_deps.sh

configure: deps
	@cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release -DKVFERRY_BUILD_PYTHON=ON $(WERROR) $(CMAKE_FLAGS) >/dev/null

build: configure
	@cmake --build $(BUILD_DIR) -j $(JOBS)

# Only the `kvferry` tool (what the demo runs), not the test suite.
build-cli: configure
	@cmake --build $(BUILD_DIR) -j $(JOBS) --target kvferry_cli

build-asan: deps
	@cmake -S . -B $(ASAN_BUILD_DIR) -DCMAKE_BUILD_TYPE=Debug -DKVFERRY_SANITIZER=address,undefined -DKVFERRY_WITH_CUDA=OFF $(WERROR) $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(ASAN_BUILD_DIR) -j $(JOBS)

build-tsan: deps
	@cmake -S . -B $(TSAN_BUILD_DIR) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVFERRY_SANITIZER=thread -DKVFERRY_WITH_CUDA=OFF -DKVFERRY_BUILD_FUZZERS=OFF $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(TSAN_BUILD_DIR) -j $(JOBS)

# The main job on its embedded default: the conversation trace when ../shared has it,
# otherwise a synthetic workload of similar lengths.
demo: build-cli
	@$(BUILD_DIR)/kvferry replay --demo

# ctest, then the Python package's pytest suite (python/tests) against the build tree.
test: build
	@cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --timeout 600
	@cmake --build $(BUILD_DIR) --target python_tests

# Same suite under AddressSanitizer + UndefinedBehaviorSanitizer (CI runs both). Built without
# CUDA: the CUDA runtime's own allocations are not ours to sanitize; the default build covers it.
test-asan: build-asan
	@cd $(ASAN_BUILD_DIR) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	  KVFERRY_TEST_SCALE=small ctest --output-on-failure -j $(JOBS) --timeout 900

# The engine and transport tests (threads, sockets, UCX workers, deadlines) under
# ThreadSanitizer (CI runs it). UCX's memory hooks (libucm) crash TSan when a thread exits: off
# here. Tests that measure resident memory are left out (TSan's shadow memory counts there);
# tests/tsan.supp names the races that are by design.
TSAN_TESTS := ^([A-Za-z]+/)?(EngineTest|EngineMetricsTest|FaultTest|UcxNetnsTest|UcxNetnsLanesTest|UcxAmTest|TcpPeerAbandonTest|ParkedQueueTest|ConnectorTest|LayerwiseConnectorTest|LayerwiseDeadlineTest|BootstrapTest|ReceiverCompletionTest|DoneMailboxTest|ControlAuthTest)\.
test-tsan: build-tsan
	@cd $(TSAN_BUILD_DIR) && UCX_MEM_MMAP_HOOK_MODE=none TSAN_OPTIONS=halt_on_error=1:report_signal_unsafe=0:suppressions=$(CURDIR)/tests/tsan.supp \
	  KVFERRY_TEST_SCALE=small ctest --output-on-failure -j $(JOBS) --timeout 900 -R '$(TSAN_TESTS)'

# The libFuzzer targets (fuzz/), built with Clang, ASan and UBSan in build-fuzz/, each run for
# FUZZ_SECONDS (default 20) on its seed corpus; fails on any crash (scripts/fuzz.sh).
fuzz: deps
	@scripts/fuzz.sh

# Long-running instances through several passes of the whole conversation trace, sampling their
# memory, threads and descriptors (scripts/soak.sh; not in CI; docs/reliability.md).
soak: build-cli
	@BUILD_DIR=$(BUILD_DIR) scripts/soak.sh

clean:
	rm -rf $(BUILD_DIR) $(ASAN_BUILD_DIR) $(TSAN_BUILD_DIR) build-fuzz
