"""bench_s3_probe.py - how long strata.probe and strata.list_dirs take on s3:// against moto
(its server in its own process on 127.0.0.1, from this venv): medians of 60 of each, after
three small checkpoints are saved. Every call resolves the URI anew; the connection is the
process's shared one (its bucket HEAD at most once a minute), so this is mostly the requests
of the call itself.

    .venv/bin/python bench/bench_s3_probe.py
"""
import statistics
import time

import torch

import strata
import strata.torch as st
from bench_s3 import moto_bench


def median_ms(fn, n=60):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main():
    with moto_bench():
        for i in range(3):
            st.save({"w": torch.ones(100)}, "s3://bench/run/step-%d" % i)
        print("probe %.2f ms  list_dirs %.2f ms  (medians of 60)" % (
            median_ms(lambda: strata.probe("s3://bench/run/step-1")),
            median_ms(lambda: strata.list_dirs("s3://bench/run"))))


if __name__ == "__main__":
    main()
