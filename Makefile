# strata - build, test, demo, bench. `make` builds build/libstrata.{a,so} and build/strata.
# Targets that need system packages install them first (make deps).

CC      ?= gcc
BUILD   ?= build
OPT     ?= -O2
SAN     ?=
CFLAGS  ?= $(OPT) -g
CFLAGS  += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -fPIC -Iinclude $(SAN)
# executables link only the shared libraries they use (MPICH only where MPI is called)
LDFLAGS += $(SAN) -Wl,--as-needed
MPI_CFLAGS := $(shell pkg-config --cflags mpich 2>/dev/null)
MPI_LIBS   := $(shell pkg-config --libs mpich 2>/dev/null || echo -lmpich)
LIBS     = -lxxhash -lpthread -ldl $(MPI_LIBS)

LIB_SRC := $(wildcard src/core/*.c src/io/*.c src/meta/*.c src/plan/*.c src/comm/*.c src/engine/*.c)
CLI_SRC := $(wildcard src/cli/*.c)
TEST_SRC := $(wildcard tests/test_*.c)
LIB_OBJ := $(LIB_SRC:%.c=$(BUILD)/obj/%.o)
CLI_OBJ := $(CLI_SRC:%.c=$(BUILD)/obj/%.o)
TESTS   := $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)

# Debian packages used by the build, tests and tools (checked, installed when missing).
DEB_PKGS = gcc make libxxhash-dev libcmocka-dev pkg-config mpich libmpich-dev

.PHONY: all deps demo test bench clean test-asan test-tsan test-valgrind check-header check-clang fuzz stress

all: deps $(BUILD)/libstrata.a $(BUILD)/libstrata.so $(BUILD)/strata $(BUILD)/examples/reshard

deps:
	@missing=""; for p in $(DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

$(BUILD)/obj/%.o: %.c | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/obj/src/comm/comm_mpi.o $(BUILD)/obj/src/cli/demo_mpi.o: CFLAGS += $(MPI_CFLAGS)

$(BUILD)/libstrata.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/libstrata.so: $(LIB_OBJ) src/libstrata.map
	$(CC) -shared $(SAN) -Wl,--version-script=src/libstrata.map -o $@ $(LIB_OBJ) $(LIBS)

$(BUILD)/strata: $(CLI_OBJ) $(BUILD)/libstrata.a
	$(CC) $(LDFLAGS) -o $@ $(CLI_OBJ) $(BUILD)/libstrata.a $(LIBS) -lm

$(BUILD)/examples/%: examples/%.c $(BUILD)/libstrata.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(BUILD)/libstrata.a $(LIBS)

$(BUILD)/tests/%: tests/%.c $(BUILD)/libstrata.a tests/testutil.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) -Isrc -o $@ $< $(BUILD)/libstrata.a -lcmocka $(LIBS) -lm

# A stand-in CUDA runtime for testing the device paths without a GPU (see tests/fake_cudart.c).
$(BUILD)/tests/libfakecudart.so: tests/fake_cudart.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -shared -o $@ $< -lpthread

demo: deps all
	$(BUILD)/strata demo

test: deps all $(TESTS) $(BUILD)/tests/libfakecudart.so
	@BUILD=$(BUILD) SANITIZED=$(if $(SAN),1,) bash tests/run.sh $(TESTS)

test-asan:
	$(MAKE) BUILD=build/asan SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all" OPT=-O1 test

test-tsan:
	$(MAKE) BUILD=build/tsan SAN="-fsanitize=thread" OPT=-O1 test

# Warning-free under clang too (installed when missing).
check-clang:
	@command -v clang >/dev/null || { SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; $$SUDO apt-get install -y -qq clang >/dev/null; }
	$(MAKE) CC=clang BUILD=build/clang all

# The public header must stand alone under -pedantic, in C and C++.
check-header:
	echo '#include "strata.h"' | $(CC) -std=c99 -pedantic -Wall -Wextra -Werror -Iinclude -x c -fsyntax-only -
	echo '#include "strata.h"' | g++ -std=c++11 -pedantic -Wall -Wextra -Werror -Iinclude -x c++ -fsyntax-only -

# Under valgrind memcheck: the core C tests, no leaks.
test-valgrind: deps all $(TESTS)
	@command -v valgrind >/dev/null || { SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; $$SUDO apt-get install -y -qq valgrind >/dev/null; }
	BUILD=$(BUILD) bash tests/valgrind.sh $(TESTS)

# libFuzzer targets (clang), each for FUZZ_SECONDS (default 60).
fuzz: deps
	@command -v clang >/dev/null || { SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; $$SUDO apt-get install -y -qq clang libclang-rt-14-dev >/dev/null; }
	bash fuzz/fuzz.sh

# The kill test at full size: SIGKILL during saves (one process, and 4 MPI processes with a
# random rank or the whole job killed; synchronous and asynchronous saves), then verify / ls / gc
# everything.
stress: deps all
	STRATA_KILL_TRIALS=$${STRATA_KILL_TRIALS:-200} BUILD=$(BUILD) bash tests/kill_test.sh
	STRATA_KILL_MODE=async STRATA_KILL_TRIALS=$${STRATA_KILL_TRIALS:-200} BUILD=$(BUILD) bash tests/kill_test.sh
	STRATA_KILL_MODE=mpi STRATA_KILL_SIZE_MB=24 STRATA_KILL_TRIALS=$${STRATA_KILL_TRIALS:-200} BUILD=$(BUILD) bash tests/kill_test.sh
	STRATA_KILL_MODE=mpiasync STRATA_KILL_SIZE_MB=24 STRATA_KILL_TRIALS=$${STRATA_KILL_TRIALS:-200} BUILD=$(BUILD) bash tests/kill_test.sh

$(BUILD)/bench/bench_plan: bench/bench_plan.c src/cli/synth.c $(BUILD)/libstrata.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Isrc -o $@ bench/bench_plan.c src/cli/synth.c $(BUILD)/libstrata.a $(LIBS) -lm

bench: deps all $(BUILD)/bench/bench_plan
	$(BUILD)/bench/bench_plan
	@command -v fio >/dev/null || { SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; $$SUDO apt-get install -y -qq fio >/dev/null; }
	bash bench/bench_io.sh
	$(BUILD)/strata bench async --dir $(BUILD) --size-mb 1024

clean:
	rm -rf build

-include $(LIB_OBJ:.o=.d) $(CLI_OBJ:.o=.d)
