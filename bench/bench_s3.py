"""bench_s3.py - s3:// upload and download throughput of strata against boto3's multipart
transfer (the peer), both against the same moto server on 127.0.0.1 (started here, in its
own process, and stopped), in one run; and each side's peak extra memory while it runs.
moto is slow (it holds every object in its own memory, in Python): the absolute figures
are moto's, the ratio strata / boto3 is what counts.

    .venv/bin/python bench/bench_s3.py [--size-mb 256] [--rounds 3] [--part-mb 8] [--threads 10]

Both sides get the same concurrency and request size: --threads (default 10, boto3's
default max_concurrency) and --part-mb. strata: strata.torch.save of one uint8 tensor of
that size with io_threads=--threads (one data file: a multipart upload of --part-mb parts
from the pool's buffers) and strata.torch.load into a tensor of the same size with
io_threads=--threads and max_io_bytes=--part-mb (ranged GETs by the loader's threads).
boto3: upload_fileobj / download_fileobj of the same bytes with
TransferConfig(multipart_chunksize=--part-mb, max_concurrency=--threads). Peak memory: the process's resident set sampled every 2 ms during each
operation, above what it was before (the tensor and the buffers being filled are the
caller's, counted for neither)."""

import argparse
import contextlib
import io
import os
import socket
import statistics
import subprocess
import sys
import threading
import time


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


@contextlib.contextmanager
def moto_bench(**env):
    """A moto server (the venv's) on 127.0.0.1, the AWS_* variables (and env) set for it,
    and its bucket "bench" made: yields a boto3 client of it; the server is stopped after."""
    port = free_port()
    server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"),
                               "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = "http://127.0.0.1:%d" % port
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_REGION": "us-east-1",
                       "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret",
                       **env})
    try:
        import boto3
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        for _ in range(100):   # until the server answers
            try:
                client.create_bucket(Bucket="bench")
                break
            except Exception:
                time.sleep(0.1)
        yield client
    finally:
        server.terminate()
        server.wait()


class PeakRSS:
    def __init__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")

    def rss(self):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self):
        self.base = self.peak = self.rss()
        self.stop = False
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()
        return self

    def run(self):
        while not self.stop:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.stop = True
        self.t.join()
        self.extra = max(0, self.peak - self.base)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--part-mb", type=int, default=8)
    ap.add_argument("--threads", type=int, default=10)
    a = ap.parse_args()
    with moto_bench(STRATA_S3_PART_MB=str(a.part_mb)) as client:
        from boto3.s3.transfer import TransferConfig
        import torch
        import strata.torch as st

        n = a.size_mb << 20
        torch.manual_seed(0)
        data = torch.randint(0, 256, (n,), dtype=torch.uint8)
        raw = data.numpy().tobytes() if hasattr(data, "numpy") else bytes(data.tolist())
        cfg = TransferConfig(multipart_threshold=a.part_mb << 20,
                             multipart_chunksize=a.part_mb << 20, max_concurrency=a.threads)
        res = {k: [] for k in ("strata_up", "strata_down", "boto3_up", "boto3_down")}
        mem = {k: 0 for k in res}
        back = torch.empty(n, dtype=torch.uint8)
        for r in range(a.rounds):
            uri = "s3://bench/strata-%d" % r
            with PeakRSS() as m:
                t0 = time.perf_counter()
                st.save({"t": data}, uri, io_threads=a.threads)
                res["strata_up"].append(time.perf_counter() - t0)
            mem["strata_up"] = max(mem["strata_up"], m.extra)
            back.zero_()
            with PeakRSS() as m:
                t0 = time.perf_counter()
                st.load({"t": back}, uri, io_threads=a.threads, max_io_bytes=a.part_mb << 20)
                res["strata_down"].append(time.perf_counter() - t0)
            mem["strata_down"] = max(mem["strata_down"], m.extra)
            assert torch.equal(back, data), "strata: the bytes loaded differ"

            key = "boto3-%d" % r
            with PeakRSS() as m:
                t0 = time.perf_counter()
                client.upload_fileobj(io.BytesIO(raw), "bench", key, Config=cfg)
                res["boto3_up"].append(time.perf_counter() - t0)
            mem["boto3_up"] = max(mem["boto3_up"], m.extra)
            out = io.BytesIO()
            with PeakRSS() as m:
                t0 = time.perf_counter()
                client.download_fileobj("bench", key, out, Config=cfg)
                res["boto3_down"].append(time.perf_counter() - t0)
            mem["boto3_down"] = max(mem["boto3_down"], m.extra)
            assert out.getvalue() == raw, "boto3: the bytes downloaded differ"
            del out
        mb = n / 1e6
        med = {k: statistics.median(v) for k, v in res.items()}
        print("s3 bench: %d MiB, %d rounds, %d MiB parts, %d threads, moto %s on 127.0.0.1 "
              "(medians)" % (a.size_mb, a.rounds, a.part_mb, a.threads,
                             __import__("moto").__version__))
        for side in ("strata", "boto3"):
            print("  %-6s upload %7.1f MB/s (peak +%4.0f MiB)   download %7.1f MB/s (peak +%4.0f MiB)"
                  % (side, mb / med[side + "_up"], mem[side + "_up"] / 2**20,
                     mb / med[side + "_down"], mem[side + "_down"] / 2**20))
        print("  ratio strata/boto3: upload %.2f, download %.2f"
              % (med["boto3_up"] / med["strata_up"], med["boto3_down"] / med["strata_down"]))


if __name__ == "__main__":
    main()
