# strata - build, test, demo, bench, install. `make` builds build/libstrata.{a,so} (no MPI),
# build/libstrata_mpi.{a,so} (the MPI communicator, strata_mpi.h) and build/strata.
# Targets that need system packages install them first (make deps).
#
# Flags: CFLAGS (default $(OPT) -g), CPPFLAGS and LDFLAGS are the user's and only add to or
# override the flags the code needs (ST_CFLAGS, ST_LDFLAGS): `make CFLAGS=-O0` works.
# Install: make install PREFIX=/usr/local (DESTDIR=... to stage).

ifeq ($(origin CC),default)
CC      = gcc
endif
BUILD   ?= build
OPT     ?= -O2
SAN     ?=
CFLAGS  ?= $(OPT) -g
ST_CFLAGS  = -std=c11 -D_GNU_SOURCE -fPIC -Iinclude -Wall -Wextra -Werror $(SAN)
ALL_CFLAGS = $(ST_CFLAGS) $(if $(CURL_ON),-DST_HAVE_CURL) $(if $(ISAL_ON),-DST_HAVE_ISAL) \
             $(CPPFLAGS) $(CFLAGS)
# executables link only the shared libraries they use (MPICH only where MPI is called)
ST_LDFLAGS = $(SAN) -Wl,--as-needed
LIBS       = -lxxhash -lz -lpthread -ldl $(if $(CURL_ON),-lcurl) $(if $(ISAL_ON),-lisal)
# MPICH's flags, looked up when a recipe that needs them runs - after `deps` has installed
# it (recursive variables: a `:=` here would run pkg-config before MPICH is there)
MPI_CFLAGS = $(shell pkg-config --cflags mpich 2>/dev/null)
MPI_LIBS   = $(shell pkg-config --libs mpich 2>/dev/null || echo -lmpich)
# libcurl (the s3:// backend, src/io/vfs_s3.c) is optional at build time: used when
# pkg-config finds it (deps installs it), looked up once when a recipe first needs it;
# CURL=0 builds without it, and an s3:// URI is then refused with STRATA_ENOTSUP.
CURL ?= auto
CURL_ON = $(eval CURL_ON := $(if $(filter 0,$(CURL)),,$(shell pkg-config --exists libcurl \
              2>/dev/null && echo 1)))$(CURL_ON)
# ISA-L (libisal-dev) is optional at build time too: its CRC-32 (crc32_gzip_refl, 4x zlib's
# here) checks the zip entries of foreign checkpoints as they are read (src/core/crc32.h);
# without it zlib's. ISAL=0 builds without it.
ISAL ?= auto
ISAL_ON = $(eval ISAL_ON := $(if $(filter 0,$(ISAL)),,$(shell pkg-config --exists libisal \
              2>/dev/null && echo 1)))$(ISAL_ON)

# the version (strata_types.h) and the shared libraries' names
VERSION_MAJOR := $(shell sed -n 's/.*define STRATA_VERSION_MAJOR \([0-9][0-9]*\).*/\1/p' include/strata_types.h)
VERSION_MINOR := $(shell sed -n 's/.*define STRATA_VERSION_MINOR \([0-9][0-9]*\).*/\1/p' include/strata_types.h)
VERSION := $(VERSION_MAJOR).$(VERSION_MINOR)
SONAME     := libstrata.so.$(VERSION_MAJOR)
MPI_SONAME := libstrata_mpi.so.$(VERSION_MAJOR)

PREFIX     ?= /usr/local
DESTDIR    ?=
BINDIR     ?= $(PREFIX)/bin
LIBDIR     ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
HEADERS := include/strata.h include/strata_types.h include/strata_comm.h include/strata_mpi.h

# libstrata: every module under src/ but the command (cli) and the MPI add-on (mpi)
LIB_SRC := $(filter-out src/cli/% src/mpi/%,$(wildcard src/*/*.c))
MPI_SRC := $(wildcard src/mpi/*.c)
CLI_SRC := $(wildcard src/cli/*.c)
TEST_SRC := $(wildcard tests/test_*.c)
LIB_OBJ := $(LIB_SRC:%.c=$(BUILD)/obj/%.o)
MPI_OBJ := $(MPI_SRC:%.c=$(BUILD)/obj/%.o)
CLI_OBJ := $(CLI_SRC:%.c=$(BUILD)/obj/%.o)
TESTS   := $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)
LIBRARIES := $(BUILD)/libstrata.a $(BUILD)/libstrata.so $(BUILD)/libstrata_mpi.a \
             $(BUILD)/libstrata_mpi.so

# Debian packages used by the build, tests and tools (checked, installed when missing).
DEB_PKGS = gcc make libxxhash-dev libcmocka-dev pkg-config mpich libmpich-dev zlib1g-dev \
           libcurl4-openssl-dev libisal-dev

# A shell function for recipes: `$(APT) apt_need PKG...` installs the Debian packages of
# the list that are not installed (apt-get update first; sudo when not root; waits for
# another apt or dpkg to finish). `$(APT) tool_need CMD PKG` installs PKG when the command
# CMD is missing.
APT = apt_need() { \
  missing=""; \
  for p in "$$@"; do \
    dpkg-query -W -f='$${Status}\n' "$$p" 2>/dev/null | grep -q ' ok installed$$' || missing="$$missing $$p"; \
  done; \
  [ -z "$$missing" ] && return 0; \
  echo "installing Debian packages:$$missing"; \
  SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
  $$SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq && \
  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq $$missing >/dev/null; \
}; \
tool_need() { command -v "$$1" >/dev/null 2>&1 || apt_need "$$2"; };

.PHONY: all lib deps demo test bench bench-incr bench-peer clean test-asan test-tsan test-valgrind check-header \
        check-clang fuzz stress install uninstall venv venv-torch test-python test-gpu

all: deps $(LIBRARIES) $(BUILD)/strata $(BUILD)/examples/reshard

lib: deps $(LIBRARIES)

# NO_DEPS=1 makes deps a no-op, for a machine without apt (the GPU machine): the packages'
# headers and libraries are then found through CPATH, LIBRARY_PATH and LD_LIBRARY_PATH.
deps:
	@$(if $(NO_DEPS),:,$(APT) apt_need $(DEB_PKGS))

$(BUILD)/obj/%.o: %.c | deps
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(EXTRA_CFLAGS) -MMD -MP -c $< -o $@

# only the MPI add-on and the command's MPI demo see MPICH's headers
$(MPI_OBJ) $(BUILD)/obj/src/cli/demo_mpi.o: EXTRA_CFLAGS = $(MPI_CFLAGS)

$(BUILD)/libstrata.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

# libstrata.so, soname libstrata.so.MAJOR (a link of that name beside it, for running
# against the build tree)
$(BUILD)/libstrata.so: $(LIB_OBJ) src/libstrata.map
	$(CC) -shared $(SAN) $(LDFLAGS) -Wl,-soname,$(SONAME) -Wl,--version-script=src/libstrata.map \
	    -o $@ $(LIB_OBJ) $(LIBS)
	ln -sf libstrata.so $(BUILD)/$(SONAME)

$(BUILD)/libstrata_mpi.a: $(MPI_OBJ)
	@rm -f $@
	ar rcs $@ $^

# the MPI add-on: exports strata_comm_mpi alone, needs libstrata and MPICH
$(BUILD)/libstrata_mpi.so: $(MPI_OBJ) src/libstrata_mpi.map $(BUILD)/libstrata.so
	$(CC) -shared $(SAN) $(LDFLAGS) -Wl,-soname,$(MPI_SONAME) \
	    -Wl,--version-script=src/libstrata_mpi.map -o $@ $(MPI_OBJ) -L$(BUILD) -lstrata $(MPI_LIBS)
	ln -sf libstrata_mpi.so $(BUILD)/$(MPI_SONAME)

# the command: the only executable with MPI (demo save/load under mpiexec)
$(BUILD)/strata: $(CLI_OBJ) $(BUILD)/libstrata_mpi.a $(BUILD)/libstrata.a
	$(CC) $(ST_LDFLAGS) $(LDFLAGS) -o $@ $(CLI_OBJ) $(BUILD)/libstrata_mpi.a $(BUILD)/libstrata.a \
	    $(MPI_LIBS) $(LIBS) -lm

# libstrata and the command once more without libcurl, for tests/nocurl_test.sh (an s3://
# URI refused with STRATA_ENOTSUP, saying so)
$(BUILD)/nocurl/strata: $(LIB_SRC) $(CLI_SRC) $(wildcard src/*/*.h) $(HEADERS)
	$(MAKE) BUILD=$(BUILD)/nocurl CURL=0 $@

$(BUILD)/examples/%: examples/%.c $(BUILD)/libstrata.a | deps
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(ST_LDFLAGS) $(LDFLAGS) -o $@ $< $(BUILD)/libstrata.a $(LIBS)

$(BUILD)/tests/%: tests/%.c $(BUILD)/libstrata.a tests/testutil.h tests/threadcomm.h \
                   tests/distutil.h tests/stdckpt.h | deps
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -MMD -MP $(ST_LDFLAGS) $(LDFLAGS) -Isrc -o $@ $< $(BUILD)/libstrata.a \
	    -lcmocka $(LIBS) -lm

# The MPI test programs of incremental saves and of stored plans (tests/mpi_test.sh runs
# them under mpiexec)
$(BUILD)/tests/mpi_%: tests/mpi_%.c $(BUILD)/libstrata_mpi.a $(BUILD)/libstrata.a | deps
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(MPI_CFLAGS) $(ST_LDFLAGS) $(LDFLAGS) -Isrc -o $@ $< \
	    $(BUILD)/libstrata_mpi.a $(BUILD)/libstrata.a $(MPI_LIBS) $(LIBS) -lm

# A stand-in CUDA runtime for testing the device paths without a GPU (see tests/fake_cudart.c).
$(BUILD)/tests/libfakecudart.so: tests/fake_cudart.c | deps
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(LDFLAGS) -shared -o $@ $< -lpthread

demo: deps all
	$(BUILD)/strata demo

# the tests' tools: python3 (cli_test, kill_test)
# the C suites, the shell suites, and (in the plain build) the Python package's tests in the
# project venv (tests/python/test_pickle_reader.py runs build/tests/pickle_dump)
test: deps all $(TESTS) $(BUILD)/tests/libfakecudart.so $(BUILD)/tests/pickle_dump \
      $(BUILD)/nocurl/strata $(if $(SAN),,venv $(BUILD)/tests/mpi_incr $(BUILD)/tests/mpi_plan)
	@$(APT) tool_need python3 python3
	@BUILD=$(BUILD) SANITIZED=$(if $(SAN),1,) VENV=$(VENV) bash tests/run.sh $(TESTS)

test-asan:
	$(MAKE) BUILD=$(BUILD)/asan SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all" OPT=-O1 test

test-tsan:
	$(MAKE) BUILD=$(BUILD)/tsan SAN="-fsanitize=thread" OPT=-O1 test

# Warning-free under clang too (installed when missing).
check-clang:
	@$(APT) tool_need clang clang
	$(MAKE) CC=clang BUILD=$(BUILD)/clang all

# The public headers must each stand alone under -pedantic, in C and C++ (g++ installed
# when missing).
check-header: deps
	@$(APT) tool_need g++ g++
	@set -e; for h in $(notdir $(HEADERS)); do \
	  echo "check-header: $$h (C99, C++11)"; \
	  echo "#include \"$$h\"" | $(CC) -std=c99 -pedantic -Wall -Wextra -Werror -Iinclude -x c -fsyntax-only -; \
	  echo "#include \"$$h\"" | g++ -std=c++11 -pedantic -Wall -Wextra -Werror -Iinclude -x c++ -fsyntax-only -; \
	done

# Under valgrind memcheck: the core C tests, no leaks.
test-valgrind: deps all $(TESTS)
	@$(APT) tool_need valgrind valgrind
	BUILD=$(BUILD) bash tests/valgrind.sh $(TESTS)

# libFuzzer targets (clang and its runtime, installed when missing), each for FUZZ_SECONDS
# (default 60).
fuzz: deps
	@$(APT) tool_need clang clang && apt_need libclang-rt-$$(clang -dumpversion | cut -d. -f1)-dev
	bash fuzz/fuzz.sh

# The kill test at full size: SIGKILL during saves (one process, and 4 MPI processes with a
# random rank or the whole job killed; synchronous and asynchronous saves), then verify / ls / gc
# everything; then the ownership trials at full size (two savers on one path, collectors beside
# saves: threads, processes, MPI jobs).
stress: deps all $(BUILD)/tests/test_own
	@$(APT) tool_need python3 python3
	STRATA_KILL_TRIALS=$${STRATA_KILL_TRIALS:-200} BUILD=$(BUILD) bash tests/kill_test.sh
	STRATA_KILL_MODE=async STRATA_KILL_TRIALS=$${STRATA_KILL_TRIALS:-200} BUILD=$(BUILD) bash tests/kill_test.sh
	STRATA_KILL_MODE=mpi STRATA_KILL_SIZE_MB=24 STRATA_KILL_TRIALS=$${STRATA_KILL_TRIALS:-200} BUILD=$(BUILD) bash tests/kill_test.sh
	STRATA_KILL_MODE=mpiasync STRATA_KILL_SIZE_MB=24 STRATA_KILL_TRIALS=$${STRATA_KILL_TRIALS:-200} BUILD=$(BUILD) bash tests/kill_test.sh
	STRATA_OWN_TRIALS=$${STRATA_OWN_TRIALS:-500} $(BUILD)/tests/test_own
	STRATA_MPI_OWN_TRIALS=$${STRATA_MPI_OWN_TRIALS:-40} BUILD=$(BUILD) bash tests/mpi_test.sh

$(BUILD)/bench/bench_plan: bench/bench_plan.c src/cli/synth.c $(BUILD)/libstrata.a | deps
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(ST_LDFLAGS) $(LDFLAGS) -Isrc -o $@ bench/bench_plan.c src/cli/synth.c \
	    $(BUILD)/libstrata.a $(LIBS) -lm

$(BUILD)/bench/bench_export: bench/bench_export.c $(BUILD)/libstrata.a | deps
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(ST_LDFLAGS) $(LDFLAGS) -o $@ bench/bench_export.c $(BUILD)/libstrata.a $(LIBS)

$(BUILD)/bench/bench_cast: bench/bench_cast.c $(BUILD)/libstrata.a | deps
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(ST_LDFLAGS) $(LDFLAGS) -o $@ bench/bench_cast.c $(BUILD)/libstrata.a $(LIBS)

$(BUILD)/bench/bench_incr: bench/bench_incr.c $(BUILD)/libstrata.a | deps
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(ST_LDFLAGS) $(LDFLAGS) -o $@ bench/bench_incr.c $(BUILD)/libstrata.a $(LIBS)

$(BUILD)/bench/bench_peer: bench/bench_peer.c tests/threadcomm.h $(BUILD)/libstrata.a | deps
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -Itests $(ST_LDFLAGS) $(LDFLAGS) -o $@ bench/bench_peer.c \
	    $(BUILD)/libstrata.a $(LIBS)

# bench/bench_s3.py: s3:// against boto3's multipart transfer on one moto server (the venv's)
bench: deps all $(BUILD)/bench/bench_plan $(BUILD)/tests/mpi_plan $(BUILD)/bench/bench_export \
       $(BUILD)/bench/bench_cast $(BUILD)/bench/bench_incr $(BUILD)/bench/bench_peer \
       $(VENV)/.strata-installed $(VENV)/.moto-installed
	$(BUILD)/bench/bench_plan
	@# a restart reusing the stored plan issues no planning collective (8 MPI processes)
	T=$$(mktemp -d) && for p in first restart changed; do \
	    timeout 300 mpiexec.mpich -n 8 $(BUILD)/tests/mpi_plan $$p $$T || { rm -rf $$T; exit 1; }; \
	done; rm -rf $$T
	@$(APT) tool_need fio fio && tool_need python3 python3
	STRATA=$(BUILD)/strata BENCH_DIR=$(BUILD)/bench bash bench/bench_io.sh
	$(BUILD)/strata bench async --dir $(BUILD) --size-mb 1024
	$(BUILD)/bench/bench_export --dir $(BUILD)/bench --size-mb 1024
	$(BUILD)/bench/bench_cast --dir $(BUILD)/bench --size-mb 1024
	$(MAKE) bench-incr
	$(MAKE) bench-peer
	$(VENV)/bin/python bench/bench_s3.py --size-mb 256
	$(VENV)/bin/python bench/bench_s3_probe.py

# bench/bench_peer.c alone (also part of `make bench`): peer-memory replicas (issue 34)
bench-peer: $(BUILD)/bench/bench_peer
	nice $(BUILD)/bench/bench_peer --dir $(BUILD)/bench --size-mb 256 --runs 5 --steps 6 \
	    --step-ms 1000 --out bench/results/peer.md

# bench/bench_incr.c alone (also part of `make bench`): LoRA full / hashed / marked, dense
bench-incr: $(BUILD)/bench/bench_incr
	$(BUILD)/bench/bench_incr --dir $(BUILD)/bench --base-mb 1024 --adapter-mb 10 \
	    --dense-mb 1024 --runs 9 --out bench/results/incremental.md

# The Python package (python/strata: the extension strata._strata carries libstrata) in a
# project-local venv, $(VENV): torch pinned (its CPU wheel installs from a local file here;
# never an unpinned torch), pytest, safetensors and numpy (safetensors.torch.save_file needs
# it, and so does a multi-rank DCP save) once, then `pip install .` again whenever the package,
# libstrata's sources or the build files change (the stamp $(VENV)/.strata-installed).
# `make venv-torch` stops there (strata and strata.torch: what a PyTorch user needs);
# `make venv` adds what `make test` needs: megatron-core, DeepSpeed (its CPU op built) and
# moto's S3 server. (pip extras for the same: strata[torch], strata[deepspeed],
# strata[megatron], strata[test]; pyproject.toml.)
# megatron-core (the writer of tests/python/test_megatron_source.py's fixtures, the framework
# strata.megatron plugs into; 0.16.1 is the last for Python 3.11) goes in without its
# dependencies, so pip never touches torch: of those it declares, numpy and torch are there
# already, `import megatron.core` needs packaging, and its checkpoint writer needs psutil.
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
MCORE_VERSION ?= 0.16.1
PSUTIL_VERSION ?= 7.2.2
PACKAGING_VERSION ?= 26.4
PY_DEPS := pyproject.toml setup.py MANIFEST.in \
           $(wildcard python/strata/*.py python/strata/*.c python/strata/*.h) \
           $(LIB_SRC) $(wildcard src/*/*.h) $(HEADERS)

venv: $(VENV)/.strata-installed $(VENV)/.mcore-installed $(VENV)/.deepspeed-op $(VENV)/.moto-installed

venv-torch: $(VENV)/.strata-installed

$(VENV)/.deps-installed:
	@$(APT) tool_need python3 python3 && apt_need libxxhash-dev gcc && \
	{ python3 -c 'import ensurepip, venv' 2>/dev/null || apt_need python3-venv; } && \
	{ python3 -c 'import os, sysconfig; p = sysconfig.get_paths()["include"]; \
	    raise SystemExit(not os.path.exists(os.path.join(p, "Python.h")))' || apt_need python3-dev; }
	[ -x $(VENV)/bin/python ] || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==$(TORCH_VERSION) pytest safetensors numpy
	@touch $@

$(VENV)/.mcore-installed: $(VENV)/.deps-installed
	$(VENV)/bin/pip install -q --no-deps megatron-core==$(MCORE_VERSION) psutil==$(PSUTIL_VERSION) \
	    packaging==$(PACKAGING_VERSION)
	@touch $@

# DeepSpeed (strata.deepspeed, tests/python/test_deepspeed.py) and its dependencies, each
# pinned and installed with --no-deps after torch, so that pip never brings another torch;
# DS_BUILD_OPS=0 compiles no op at install. On CPU, DeepSpeed JIT-builds its shared-memory
# allreduce at its first run (g++, ninja pinned here; 25 s to 7 minutes) into
# $TORCH_EXTENSIONS_DIR: $(VENV)/.deepspeed-op builds it once into $(VENV)/torch_extensions
# (where tests/run.sh points TORCH_EXTENSIONS_DIR), and a .pth file in the venv's
# site-packages sets TORCH_EXTENSIONS_DIR to that directory for the venv's Python when it is
# not set, so that a user's first run finds it built. Only on DeepSpeed's CPU accelerator
# (a GPU machine builds no such op).
DEEPSPEED_PKGS = deepspeed==0.19.8 einops==0.8.2 hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 \
                 psutil==$(PSUTIL_VERSION) py-cpuinfo==9.0.0 pydantic==2.14.4 pydantic_core==2.50.5 \
                 annotated-types==0.8.0 typing-inspection==0.4.5 tqdm==4.70.1

$(VENV)/.deepspeed-installed: $(VENV)/.deps-installed
	@$(APT) tool_need g++ g++
	DS_BUILD_OPS=0 $(VENV)/bin/pip install -q --no-deps $(DEEPSPEED_PKGS)
	@touch $@

# moto's S3 server (tests/python/test_s3.py, tests/s3_test.sh, make bench's S3 figures) and
# boto3 (the peer the S3 figures compare with): moto[server] 5.2.5 and every dependency it
# pulls in, each pinned and installed with --no-deps, so that pip never touches torch (of
# those, sympy, networkx, mpmath, jinja2, markupsafe, typing-extensions and pydantic's are
# torch's or DeepSpeed's, pinned here at the versions those bring).
MOTO_PKGS = moto[server]==5.2.5 antlr4-python3-runtime==4.13.2 attrs==26.1.0 aws-xray-sdk==2.15.0 \
            blinker==1.9.0 boto3==1.44.8 botocore==1.44.8 certifi==2026.10.19.post1 cffi==2.1.1 \
            cfn-lint==1.58.0 charset-normalizer==3.5.2 click==8.5.1 cryptography==50.0.2 \
            docker==7.2.0 flask==3.1.3 flask-cors==6.0.5 graphql-core==3.3.2 idna==3.20 \
            itsdangerous==2.2.0 jmespath==1.1.0 joserfc==1.8.0 jsonpatch==1.48 jsonpath-ng==1.16.0 \
            jsonpointer==3.12 jsonschema==4.26.0 jsonschema-path==0.5.0 \
            jsonschema-specifications==2025.9.1 lazy-object-proxy==1.13.0 \
            openapi-schema-validator==0.9.0 openapi-spec-validator==0.9.0 pathable==0.6.0 \
            py-partiql-parser==0.6.3 pycparser==3.12 pydantic-settings==2.16.3 pyparsing==3.3.3 \
            python-dateutil==2.9.0.post0 python-dotenv==1.2.4 pyyaml==6.0.4 referencing==0.37.0 \
            regex==2026.11.19 requests==2.34.2 responses==0.26.3 rfc3339-validator==0.1.4 \
            rpds-py==2026.9.1 s3transfer==0.19.3 six==1.17.0 urllib3==2.8.0 werkzeug==3.1.9 \
            wrapt==2.5.2 xmltodict==1.0.4 sympy==1.14.0 networkx==3.6.1 mpmath==1.3.0 \
            jinja2==3.1.6 markupsafe==3.0.4 typing-extensions==4.16.0 pydantic==2.14.4 \
            pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5

$(VENV)/.deepspeed-op: $(VENV)/.deepspeed-installed
	$(VENV)/bin/python -c 'import os, sysconfig; \
	    open(os.path.join(sysconfig.get_paths()["purelib"], "strata-torch-extensions.pth"), "w").write( \
	        "import os, sys; os.environ.setdefault(\"TORCH_EXTENSIONS_DIR\", " \
	        "os.path.join(sys.prefix, \"torch_extensions\"))\n")'
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions $(VENV)/bin/python -W ignore -c \
	    'import deepspeed.ops; from deepspeed.accelerator import get_accelerator as a; \
	    b = a().create_op_builder("ShareMemCommBuilder") if a()._name == "cpu" else None; \
	    b is not None and deepspeed.ops.__compatible_ops__.get(b.NAME) and b.load()'
	@touch $@

$(VENV)/.moto-installed: $(VENV)/.deps-installed
	$(VENV)/bin/pip install -q --no-deps '$(firstword $(MOTO_PKGS))' $(wordlist 2,999,$(MOTO_PKGS))
	@touch $@

$(VENV)/.strata-installed: $(VENV)/.deps-installed $(PY_DEPS)
	$(VENV)/bin/pip install -q .
	@touch $@

# The Python tests alone (pytest; torch CPU, gloo). `make test` runs them too.
test-python: venv
	$(VENV)/bin/python -m pytest -q tests/python

# The device tests, on a machine with a GPU (not part of `make test`): the C tests that touch
# device memory (test_cuda, test_pool's pinned pool; test_api and test_async as a sanity check)
# built in $(GPU_BUILD) and run against the real CUDA runtime, then the torch tests with CUDA
# tensors (tests/python/test_torch_cuda.py, marker gpu), with the package built for
# $(GPU_PYTHON) (a python whose torch has CUDA) into $(GPU_BUILD)/site. A test that finds no
# usable device fails here instead of skipping. STRATA_CUDART names the runtime (else
# tests/gpu_test.sh finds one). Without apt: make test-gpu NO_DEPS=1 (see deps).
GPU_BUILD  ?= $(BUILD)/gpu
GPU_PYTHON ?= python3
GPU_TESTS  := test_cuda test_pool test_api test_async

test-gpu: deps
	$(MAKE) BUILD=$(GPU_BUILD) $(addprefix $(GPU_BUILD)/tests/,$(GPU_TESTS))
	BUILD=$(GPU_BUILD) PYTHON=$(GPU_PYTHON) bash tests/gpu_test.sh \
	    $(addprefix $(GPU_BUILD)/tests/,$(GPU_TESTS))

# pkg-config files: the install's directories, and MPICH's flags for strata-mpi. The static
# link's libraries come from the packages' own .pc files (Requires.private: libcurl's lists
# its private libraries, which a link with libcurl.a needs). A LIBDIR the dynamic linker does
# not search by default (a PREFIX such as $HOME/strata) gets an rpath in Libs, so that a
# program linked with `pkg-config --libs strata` finds libstrata.so.MAJOR there when it
# starts; PC_RPATH= leaves it out (then LD_LIBRARY_PATH=LIBDIR).
SYSTEM_LIBDIRS := /lib /lib64 /usr/lib /usr/lib64 /usr/local/lib \
                  $(addprefix /usr/lib/,$(shell $(CC) -print-multiarch 2>/dev/null)) \
                  $(addprefix /lib/,$(shell $(CC) -print-multiarch 2>/dev/null))
PC_RPATH ?= $(if $(filter $(SYSTEM_LIBDIRS),$(patsubst %/,%,$(LIBDIR))),,-Wl,-rpath,$${libdir} )
$(BUILD)/strata.pc: src/strata.pc.in | deps
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@LIBDIR@|$(LIBDIR)|g' -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|g' \
	    -e 's|@VERSION@|$(VERSION)|g' -e 's|@CURL_PC@|$(if $(CURL_ON),libcurl)|g' \
	    -e 's|@ISAL_PC@|$(if $(ISAL_ON),libisal)|g' -e 's|@RPATH@|$(PC_RPATH)|g' $< >$@

$(BUILD)/strata-mpi.pc: src/strata-mpi.pc.in | deps
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@LIBDIR@|$(LIBDIR)|g' -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|g' \
	    -e 's|@VERSION@|$(VERSION)|g' -e 's|@MPI_CFLAGS@|$(MPI_CFLAGS)|g' \
	    -e 's|@MPI_LIBS@|$(MPI_LIBS)|g' $< >$@

# always regenerated: PREFIX and the directories may differ from the last install
.PHONY: $(BUILD)/strata.pc $(BUILD)/strata-mpi.pc

# Headers, both libraries (static; shared as libX.so.MAJOR.MINOR with the soname link
# libX.so.MAJOR and the link-time link libX.so), the command, and strata.pc / strata-mpi.pc.
install: deps $(LIBRARIES) $(BUILD)/strata $(BUILD)/strata.pc $(BUILD)/strata-mpi.pc
	install -d $(DESTDIR)$(INCLUDEDIR) $(DESTDIR)$(LIBDIR) $(DESTDIR)$(PKGCONFIGDIR) \
	    $(DESTDIR)$(BINDIR)
	install -m 644 $(HEADERS) $(DESTDIR)$(INCLUDEDIR)/
	install -m 644 $(BUILD)/libstrata.a $(BUILD)/libstrata_mpi.a $(DESTDIR)$(LIBDIR)/
	install -m 755 $(BUILD)/libstrata.so $(DESTDIR)$(LIBDIR)/$(SONAME).$(VERSION_MINOR)
	ln -sf $(SONAME).$(VERSION_MINOR) $(DESTDIR)$(LIBDIR)/$(SONAME)
	ln -sf $(SONAME) $(DESTDIR)$(LIBDIR)/libstrata.so
	install -m 755 $(BUILD)/libstrata_mpi.so $(DESTDIR)$(LIBDIR)/$(MPI_SONAME).$(VERSION_MINOR)
	ln -sf $(MPI_SONAME).$(VERSION_MINOR) $(DESTDIR)$(LIBDIR)/$(MPI_SONAME)
	ln -sf $(MPI_SONAME) $(DESTDIR)$(LIBDIR)/libstrata_mpi.so
	install -m 644 $(BUILD)/strata.pc $(BUILD)/strata-mpi.pc $(DESTDIR)$(PKGCONFIGDIR)/
	install -m 755 $(BUILD)/strata $(DESTDIR)$(BINDIR)/
	@# a system LIBDIR (/usr/local/lib): the dynamic linker's cache learns the new library
	@if [ -z "$(DESTDIR)" ] && [ -z "$(PC_RPATH)" ] && [ "$$(id -u)" = 0 ] && \
	    command -v ldconfig >/dev/null; then ldconfig; fi

uninstall:
	rm -f $(addprefix $(DESTDIR)$(INCLUDEDIR)/,$(notdir $(HEADERS))) \
	    $(addprefix $(DESTDIR)$(LIBDIR)/,libstrata.a libstrata_mpi.a libstrata.so $(SONAME) \
	        $(SONAME).$(VERSION_MINOR) libstrata_mpi.so $(MPI_SONAME) $(MPI_SONAME).$(VERSION_MINOR)) \
	    $(DESTDIR)$(PKGCONFIGDIR)/strata.pc $(DESTDIR)$(PKGCONFIGDIR)/strata-mpi.pc \
	    $(DESTDIR)$(BINDIR)/strata

clean:
	rm -rf build

-include $(LIB_OBJ:.o=.d) $(MPI_OBJ:.o=.d) $(CLI_OBJ:.o=.d) $(TESTS:=.d)

# make bench-torch: strata beside torch.save and DCP in a training loop (bench/torch.mk)
-include bench/torch.mk
