"""bench_s3_probe.py - how long strata.probe and strata.list_dirs take on s3:// against moto
(its server in its own process on 127.0.0.1, from this venv): medians of 60 of each, after
three small checkpoints are saved. Every call resolves the URI anew, so this is the cost of
a resolve (connection, bucket HEAD) plus the requests of the call itself.

    .venv/bin/python bench/bench_s3_probe.py
"""
import os
import socket
import statistics
import subprocess
import sys
import time

import boto3
import torch

import strata
import strata.torch as st


def median_ms(fn, n=60):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
    srv = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ep = "http://127.0.0.1:%d" % port
        os.environ.update({"AWS_ENDPOINT_URL": ep, "AWS_REGION": "us-east-1",
                           "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"})
        client = boto3.client("s3", endpoint_url=ep, region_name="us-east-1")
        for _ in range(100):
            try:
                client.create_bucket(Bucket="bench")
                break
            except Exception:
                time.sleep(0.1)
        for i in range(3):
            st.save({"w": torch.ones(100)}, "s3://bench/run/step-%d" % i)
        print("probe %.2f ms  list_dirs %.2f ms  (medians of 60)" % (
            median_ms(lambda: strata.probe("s3://bench/run/step-1")),
            median_ms(lambda: strata.list_dirs("s3://bench/run"))))
    finally:
        srv.kill()
        srv.wait()


if __name__ == "__main__":
    main()
