# shmrpc — build, test, bench. `make help` lists the targets.
#
#   make demo              install what is missing, build, run a small job
#   make check             install what is missing, build, run every test
#   make check SAN=address (or SAN=thread) the same under a sanitizer
#   make bench             figures beside their peers (BENCH lines)
#   make torch-suite       torch's own RPC test suites, run against shmrpc
#   make gpu               build/gpu: what tests/gpu.sh runs, to carry to a GPU
#   make install PREFIX=/usr/local

CC       ?= gcc
PREFIX   ?= /usr/local
SAN      ?=
TEST_TIMEOUT ?= 300
# Every Debian package a test needs, python3-torch included (make check fails
# a test that finds one missing rather than skip it: .ci/allowed-skips); the
# benches need no more.
DEB_PKGS := liburing-dev libxxhash-dev libdlpack-dev libmsgpack-dev python3-dev python3-pip \
	    python3-numpy python3-pytest python3-torch
BENCH_PKGS :=

ifeq ($(SAN),)
BUILD    ?= build
SANFLAGS :=
else ifeq ($(SAN),address)
BUILD    ?= build/san-address
SANFLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
else ifeq ($(SAN),thread)
BUILD    ?= build/san-thread
SANFLAGS := -fsanitize=thread -fno-omit-frame-pointer
else
$(error SAN must be address or thread)
endif

WARN     := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wmissing-prototypes
CPPFLAGS += -I. -Iinclude -D_GNU_SOURCE
# msgpack's sbuffer starts at 8 KiB: a malloc outside the thread cache on
# every call and reply, whose payloads are mostly tens of bytes.
CPPFLAGS += -DMSGPACK_SBUFFER_INIT_SIZE=256
CFLAGS   += -std=gnu11 -O2 -g -fPIC -fvisibility=hidden $(WARN) $(SANFLAGS)
LDFLAGS  += $(SANFLAGS)
# liburing and msgpack-c are linked statically so that the library runs
# where only its .so is carried (the GPU machine); xxHash is compiled inline.
MULTIARCH := $(shell $(CC) -dumpmachine)
static_or = $(or $(firstword $(wildcard /usr/lib/$(MULTIARCH)/lib$(1).a /usr/lib/lib$(1).a)),-l$(1))
LIBS     := $(call static_or,uring) $(call static_or,msgpackc) -lpthread

LIB_SRCS := $(wildcard common/*.c shm/*.c ipc/*.c worker/*.c)
LIB_OBJS := $(LIB_SRCS:%.c=$(BUILD)/obj/%.o)
TESTLIB_SRCS := $(wildcard tests/lib/*.c)
TESTLIB_OBJS := $(TESTLIB_SRCS:%.c=$(BUILD)/obj/%.o)
# The Python test modules are entries of their own, py_NAME: links to the
# one program that runs a module, tests/python_test.c (not an entry itself).
PY_TEST_SRCS := $(wildcard tests/python/test_*.py)
TEST_SRCS := $(filter-out tests/python_test.c,$(wildcard tests/*.c))
TESTS    := $(TEST_SRCS:tests/%.c=$(BUILD)/tests/%) \
	    $(PY_TEST_SRCS:tests/python/test_%.py=$(BUILD)/tests/py_%)
BENCH_SRCS := $(wildcard bench/*.c)
BENCHES  := $(BENCH_SRCS:bench/%.c=$(BUILD)/bench/%)
EXAMPLE_SRCS := $(wildcard examples/*.c)
EXAMPLES := $(EXAMPLE_SRCS:examples/%.c=$(BUILD)/examples/%)
TOOL_SRCS := $(wildcard tools/*.c)
TOOLS    := $(TOOL_SRCS:tools/%.c=$(BUILD)/bin/%)
# shmrpc-inspect's parts, one file per subject (tools/inspect/inspect.h).
INSPECT_OBJS := $(patsubst %.c,$(BUILD)/obj/%.o,$(wildcard tools/inspect/*.c))
LAUNCHER_SRCS := $(wildcard launcher/*.c)
LAUNCHER := $(if $(LAUNCHER_SRCS),$(BUILD)/bin/shmrun)
RUNNER   := $(BUILD)/bin/shmrpc-test-runner
# A stand-in CUDA driver (host memory as device memory) for the tests of
# device tensors on machines without a GPU; they load it by SHMRPC_LIBCUDA.
FAKE_CUDA := $(BUILD)/tests/fake_cuda/libcuda.so.1
# The Python package: the extension (stable ABI) beside its modules. Not
# in sanitizer builds: a sanitized extension needs its runtime preloaded
# into python3, and the C tests cover the same library code.
PY_INC   := $(shell /usr/bin/python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])" 2>/dev/null)
PY_MODS  := $(wildcard python/shmrpc/*.py)
PY_C_SRCS := $(wildcard python/*.c)
PYTHON   := $(if $(and $(wildcard $(PY_INC)/Python.h),$(if $(SAN),,yes)),$(BUILD)/python/shmrpc/_shmrpc.abi3.so \
		$(PY_MODS:python/%=$(BUILD)/python/%))

.PHONY: all deps bench-deps check demo bench fuzz install clean help python torch-suite gpu
all: $(BUILD)/libshmrpc.a $(BUILD)/libshmrpc.so $(TESTS) $(BENCHES) $(EXAMPLES) $(TOOLS) $(LAUNCHER) $(RUNNER) $(FAKE_CUDA) $(PYTHON)
python: $(PYTHON)

help:
	@sed -n '2,10p' Makefile | sed 's/^# \{0,1\}//'

# What tests/gpu.sh runs on a machine with a GPU, and nothing more, in one
# folder of plain files (no links) to carry there: shmrun, the GPU tests
# (cuda_ipc; the Python modules through python_test NAME), the benches,
# the inspector (bench/python_rpc_phases.py reads the flight recorders
# with it) and the Python package. About 12 MiB; a device machine takes
# 64 MiB.
GPU_BUILD := $(BUILD)/gpu
gpu: $(LAUNCHER) $(TOOLS) $(BUILD)/tests/cuda_ipc $(BUILD)/tests/python_test $(BENCHES) $(PYTHON)
	rm -rf $(GPU_BUILD)
	mkdir -p $(GPU_BUILD)/bin $(GPU_BUILD)/tests $(GPU_BUILD)/bench
	cp $(LAUNCHER) $(TOOLS) $(GPU_BUILD)/bin/
	cp $(BUILD)/tests/cuda_ipc $(BUILD)/tests/python_test $(GPU_BUILD)/tests/
	cp $(BENCHES) $(GPU_BUILD)/bench/
	cp -RL $(BUILD)/python $(GPU_BUILD)/python
	@du -sh $(GPU_BUILD)

# Debian packages: apt-get update once, then install what is missing.
deps:
	@sh .ci/deps.sh $(DEB_PKGS)
bench-deps:
	@sh .ci/deps.sh $(DEB_PKGS) $(BENCH_PKGS)

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -MMD -MP -c -o $@ $<

$(BUILD)/libshmrpc.a: $(LIB_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/libshmrpc.so: $(LIB_OBJS) libshmrpc.map
	$(CC) -shared -Wl,-soname,libshmrpc.so.0 -Wl,--no-undefined -Wl,--version-script=libshmrpc.map \
		$(LDFLAGS) -o $@ $(LIB_OBJS) $(LIBS)

$(BUILD)/tests/%: $(BUILD)/obj/tests/%.o $(TESTLIB_OBJS) $(BUILD)/libshmrpc.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LIBS)

$(BUILD)/tests/py_%: $(BUILD)/tests/python_test
	ln -sf python_test $@

$(BUILD)/bench/%: $(BUILD)/obj/bench/%.o $(BUILD)/libshmrpc.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LIBS)

$(BUILD)/examples/%: $(BUILD)/obj/examples/%.o $(BUILD)/libshmrpc.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LIBS)

$(BUILD)/bin/%: $(BUILD)/obj/tools/%.o $(BUILD)/libshmrpc.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LIBS)

$(BUILD)/bin/shmrpc-inspect: $(BUILD)/obj/tools/shmrpc-inspect.o $(INSPECT_OBJS) $(BUILD)/libshmrpc.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LIBS)

$(BUILD)/bin/shmrun: $(LAUNCHER_SRCS:%.c=$(BUILD)/obj/%.o) $(BUILD)/libshmrpc.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LIBS)

$(BUILD)/obj/python/%.o: python/%.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) -isystem $(PY_INC) $(CFLAGS) -MMD -MP -c -o $@ $<

# The extension: its C files, launcher/job_shm.c for the jobs that
# shmrpc.data launches itself, and launcher/keeper.c (with seg_watch.c,
# its header and slot checks) for the keeper of a job that processes join
# without shmrun.
$(BUILD)/python/shmrpc/_shmrpc.abi3.so: $(PY_C_SRCS:%.c=$(BUILD)/obj/%.o) $(BUILD)/obj/launcher/job_shm.o \
		$(BUILD)/obj/launcher/keeper.o $(BUILD)/obj/launcher/seg_watch.o $(LIB_OBJS)
	@mkdir -p $(dir $@)
	$(CC) -shared $(LDFLAGS) -o $@ $^ $(LIBS)

$(BUILD)/python/shmrpc/%.py: python/shmrpc/%.py
	@mkdir -p $(dir $@)
	cp $< $@

$(FAKE_CUDA): $(BUILD)/obj/tests/fake_cuda/fake_cuda.o
	@mkdir -p $(dir $@)
	$(CC) -shared $(LDFLAGS) -o $@ $^ -lpthread

$(RUNNER): $(BUILD)/obj/tests/runner/runner.o
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^

# The fuzz targets (one per file of fuzz/: what decodes frames and values,
# what walks the pool's and the RRef table's metadata) need clang's
# libFuzzer runtime (libclang-rt-14-dev).
FUZZ_CC  ?= clang
FUZZ_BINS := $(patsubst fuzz/%.c,build/fuzz/%,$(wildcard fuzz/*.c))
fuzz: $(FUZZ_BINS)
build/fuzz/%: fuzz/%.c $(LIB_SRCS)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(CPPFLAGS) -std=gnu11 -g -O1 -fsanitize=fuzzer,address,undefined -o $@ \
		$< $(LIB_SRCS) $(LIBS)

check: deps
	@$(MAKE) --no-print-directory all
	@fuzz=; if [ -z "$(SAN)" ] && sh .ci/has-fuzzer.sh "$(FUZZ_CC)"; then \
		$(MAKE) --no-print-directory fuzz && fuzz="$(FUZZ_BINS)"; fi; \
	SHMRPC_BUILD=$(BUILD) SHMRPC_SAN=$(SAN) SHMRPC_FUZZ="$$fuzz" $(RUNNER) -t $(TEST_TIMEOUT) \
		-a .ci/allowed-skips $(TESTS)

# torch's own RPC suites against shmrpc (tests/torch_suite/run.py; long:
# a spawned 4-process job per test). docs/COMPAT.md lists what fails, and why.
torch-suite: deps
	@$(MAKE) --no-print-directory python $(LAUNCHER)
	@PYTHONPATH=$(BUILD)/python /usr/bin/python3 tests/torch_suite/run.py $(SUITE_ARGS)

demo: deps
	@$(MAKE) --no-print-directory all
	@sh examples/demo.sh $(BUILD)

bench: bench-deps
	@$(MAKE) --no-print-directory all
	@sh bench/run.sh $(BUILD)

install: $(BUILD)/libshmrpc.a $(BUILD)/libshmrpc.so $(LAUNCHER) $(TOOLS)
	install -d $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/bin
	install -m 644 $(BUILD)/libshmrpc.a $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(BUILD)/libshmrpc.so $(DESTDIR)$(PREFIX)/lib/libshmrpc.so.0
	ln -sf libshmrpc.so.0 $(DESTDIR)$(PREFIX)/lib/libshmrpc.so
	install -m 644 include/shmrpc.h $(DESTDIR)$(PREFIX)/include/
	$(if $(LAUNCHER)$(TOOLS),install -m 755 $(LAUNCHER) $(TOOLS) $(DESTDIR)$(PREFIX)/bin/)
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|$(shell sed -n 's/.*SHMRPC_VERSION_STRING "\(.*\)"/\1/p' include/shmrpc.h)|' \
		shmrpc.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/shmrpc.pc

clean:
	rm -rf build

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
.SECONDARY:
