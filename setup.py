"""Builds strata._strata: python/strata/_strata*.c (the binding, a C file per concept sharing
the internal _strata.h) plus every C file of libstrata (carried statically: src/core, io,
meta, plan, comm, source, engine; not the command, not MPI). The metadata is in pyproject.toml;
`pip install .` from the repository root."""
import glob
import os
import re
import subprocess

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
os.chdir(HERE)  # setuptools wants source paths relative to the project root

LIB_DIRS = ("core", "io", "meta", "plan", "comm", "source", "engine", "tools")


def version():
    text = open(os.path.join("include", "strata_types.h")).read()
    major = re.search(r"define STRATA_VERSION_MAJOR (\d+)", text).group(1)
    minor = re.search(r"define STRATA_VERSION_MINOR (\d+)", text).group(1)
    return "%s.%s.0" % (major, minor)


def have_curl():
    """libcurl (the s3:// backend) when its headers are there, as the Makefile decides;
    STRATA_CURL=0 builds without it (an s3:// URI is then refused)."""
    if os.environ.get("STRATA_CURL") == "0":
        return False
    return subprocess.call(["pkg-config", "--exists", "libcurl"], stderr=subprocess.DEVNULL) == 0


def have_isal():
    """ISA-L (its CRC-32 checks foreign checkpoints' zip entries) when pkg-config finds it,
    as the Makefile decides; STRATA_ISAL=0 builds without it (zlib's CRC-32 then)."""
    if os.environ.get("STRATA_ISAL") == "0":
        return False
    return subprocess.call(["pkg-config", "--exists", "libisal"], stderr=subprocess.DEVNULL) == 0


CURL = have_curl()
ISAL = have_isal()
sources = sorted(glob.glob("python/strata/_strata*.c"))
for d in LIB_DIRS:
    sources += sorted(glob.glob("src/%s/*.c" % d))

ext = Extension(
    "strata._strata",
    sources=sources,
    include_dirs=["include"],  # the binding uses the public headers only
    depends=sorted(
        glob.glob("include/*.h") + glob.glob("src/*/*.h") + glob.glob("python/strata/*.h")
    ),
    extra_compile_args=[
        "-std=c11", "-D_GNU_SOURCE", "-O2", "-fvisibility=hidden", "-Wall", "-Wextra",
    ],
    define_macros=([("ST_HAVE_CURL", "1")] if CURL else []) +
                  ([("ST_HAVE_ISAL", "1")] if ISAL else []),
    libraries=["xxhash", "z", "pthread", "dl"] + (["curl"] if CURL else []) +
              (["isal"] if ISAL else []),
)

setup(
    version=version(),
    ext_modules=[ext],
    # setuptools' build tree beside, not inside, the Makefile's build/ outputs
    options={"build": {"build_base": "build/python"}, "build_ext": {"parallel": os.cpu_count() or 1}},
)
