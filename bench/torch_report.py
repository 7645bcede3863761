"""The report of `make bench-torch`: medians (min, max) over rounds, the goals of the issue
against the measured figures, the ratios strata/DCP and strata/torch.save, a chart.

write(info, metas, rows, out_dir) writes out_dir/torch.md and out_dir/torch.png and returns
the last line (the ratios)."""

import datetime
import math
import os
import statistics

MIB = 1 << 20
PRIMARY = "1p-fp32"
DCP_ASYNC = ["dcp_async", "dcp_async_stager", "dcp_async_shm", "dcp_async_astage",
             "dcp_async_shm_astage"]
DCP_SAVE = ["dcp_save_t1", "dcp_save_t4"]
SAVE_ORDER = ["torch_save"] + DCP_SAVE + DCP_ASYNC + ["strata_save", "strata_async",
                                                      "strata_mgr"]
LOAD_ORDER = ["torch_load", "torch_load_mmap", "dcp_load", "strata_load", "strata_mgr_load",
              "dcp_load_4", "strata_load_4", "dcp_load_3", "strata_load_3", "dcp_load_1",
              "strata_load_1"]


class Agg:
    def __init__(self, rows):
        self.v = {}
        for r in rows:
            if r["value"] is None:
                continue
            self.v.setdefault((r["config"], r["system"], r["metric"]), []).append(r["value"])

    def vals(self, config, system, metric):
        return self.v.get((config, system, metric), [])

    def med(self, config, system, metric):
        xs = self.vals(config, system, metric)
        return statistics.median(xs) if xs else None

    def cell(self, config, system, metric, fmt="%.3f", scale=1.0):
        xs = self.vals(config, system, metric)
        if not xs:
            return "-"
        m = statistics.median(xs) * scale
        if len(xs) == 1:
            return fmt % m
        return (fmt + " (" + fmt + "-" + fmt + ")") % (m, min(xs) * scale, max(xs) * scale)


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def _pos_ratio(a, b):
    """a / b where both are positive (a stall below zero is noise: a period shorter than its
    steps measured apart), else None."""
    return _ratio(a, b) if a is not None and b is not None and a > 0 and b > 0 else None


def _f(x, fmt="%.2f"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt % x


def _best(agg, config, systems, metric):
    """(system, median) with the lowest median of metric among systems."""
    best = None
    for s in systems:
        m = agg.med(config, s, metric)
        if m is not None and (best is None or m < best[1]):
            best = (s, m)
    return best or (None, None)


def disk_rates(agg):
    """The disk's write and read rates every "of disk" figure is taken against: measured the
    way strata uses it (strata bench disk, its I/O buffers), or fio's where that is missing."""
    w, r = agg.med("env", "disk", "write_gbps"), agg.med("env", "disk", "read_gbps")
    if w is None or r is None:
        return agg.med("env", "fio", "write_gbps"), agg.med("env", "fio", "read_gbps")
    return w, r


def _cfg4(info):
    return next((c for c in info["configs"] if c.startswith("4p")), None)


def figures(info, agg):
    """The line's figures and the goals' table rows."""
    cfg = PRIMARY
    disk_w, disk_r = disk_rates(agg)
    f = {}
    dcp_stall = _best(agg, cfg, DCP_ASYNC, "stall_s")
    dcp_dur = _best(agg, cfg, DCP_ASYNC, "durable_s")
    f["stall_ratio_vs_dcp_async"] = _pos_ratio(agg.med(cfg, "strata_async", "stall_s"),
                                               dcp_stall[1])
    f["mgr_stall_ratio_vs_async"] = _pos_ratio(agg.med(cfg, "strata_mgr", "stall_s"),
                                               agg.med(cfg, "strata_async", "stall_s"))
    f["durable_ratio_vs_dcp_async"] = _ratio(agg.med(cfg, "strata_async", "durable_s"),
                                             dcp_dur[1])
    f["save_of_disk"] = _ratio(agg.med(cfg, "strata_save", "save_gbps"), disk_w)
    f["load_of_disk"] = _ratio(agg.med(cfg, "strata_load", "load_gbps"), disk_r)
    c4 = _cfg4(info)
    f["reshard_ratio_vs_dcp"] = _ratio(agg.med(c4, "strata_load_3", "load_s"),
                                       agg.med(c4, "dcp_load_3", "load_s")) if c4 else None
    f["reshard_load_of_disk"] = _ratio(agg.med(c4, "strata_load_3", "load_gbps"),
                                       disk_r) if c4 else None
    f["load_ratio_vs_torch_mmap"] = _ratio(agg.med(cfg, "strata_load", "load_s"),
                                           agg.med(cfg, "torch_load_mmap", "load_s"))
    f["load_ratio_vs_torch_mmap_bf16"] = _ratio(agg.med("1p-bf16", "strata_load", "load_s"),
                                                agg.med("1p-bf16", "torch_load_mmap", "load_s"))
    f["load_req_kib"] = agg.med(cfg, "strata_load", "req_kib")
    f["load_read_kib"] = agg.med(cfg, "strata_load", "read_kib")
    f["peak_extra_ratio_vs_dcp"] = _ratio(agg.med(cfg, "strata_load", "peak_extra_load"),
                                          agg.med(cfg, "dcp_load", "peak_extra_load"))
    return f, dcp_stall, dcp_dur, disk_w, disk_r


def goals(info, metas, agg, f, dcp_stall, dcp_dur, disk_w, disk_r):
    cfg = PRIMARY
    out = []

    def add(goal, measured, ok, note=""):
        out.append((goal, measured, "met" if ok else ("MISSED" if ok is not None else "n/a"),
                    note))

    r = f["stall_ratio_vs_dcp_async"]
    add("stall per checkpoint <= 1/10 of DCP async's best (%s)" % (dcp_stall[0] or "-"),
        "strata %s s vs %s s: ratio %s" % (_f(agg.med(cfg, "strata_async", "stall_s"), "%.3f"),
                                           _f(dcp_stall[1], "%.3f"), _f(r)),
        None if r is None else r <= 0.1,
        "" if r is None or r <= 0.1 else "%.1fx the allowed stall" % (r / 0.1))
    ov = agg.med(cfg, "strata_async", "overhead_pct")
    add("training overhead with a checkpoint every %d steps < 3 %%"
        % metas.get(cfg, [{}])[0].get("k", 0),
        "strata async_save %s %%" % _f(ov, "%.1f"), None if ov is None else ov < 3.0,
        "" if ov is None or ov < 3 else "%.1f points over" % (ov - 3.0))
    r = f["durable_ratio_vs_dcp_async"]
    add("time to durable (async) <= 1/2 of DCP's (best: %s)" % (dcp_dur[0] or "-"),
        "strata %s s vs %s s: ratio %s" % (_f(agg.med(cfg, "strata_async", "durable_s"), "%.3f"),
                                           _f(dcp_dur[1], "%.3f"), _f(r)),
        None if r is None else r <= 0.5,
        "" if r is None or r <= 0.5 else "%.2fx the allowed time" % (r / 0.5))
    r = f["mgr_stall_ratio_vs_async"]
    add("manager ([/dev/shm, disk]) stall <= 1.1x async alone's",
        "%s s vs %s s: ratio %s" % (_f(agg.med(cfg, "strata_mgr", "stall_s"), "%.3f"),
                                    _f(agg.med(cfg, "strata_async", "stall_s"), "%.3f"), _f(r)),
        None if r is None else r <= 1.1,
        "" if r is None or r <= 1.1 else "%.1fx the allowed stall" % (r / 1.1))
    for key, goal, lim in (("save_of_disk", "blocking save >= 0.95 of the disk's write rate", 0.95),
                           ("load_of_disk", "one-process cold load >= 0.95 of the disk's read "
                            "rate", 0.95),
                           ("reshard_load_of_disk", "resharded load 4 -> 3 >= 0.9 of the disk's "
                            "read rate", 0.9)):
        x = f[key]
        add(goal, _f(x), None if x is None else x >= lim,
            "" if x is None or x >= lim else "%.0f %% short" % ((lim - x) / lim * 100))
    x = f["reshard_ratio_vs_dcp"]
    add("resharded load 4 -> 3 <= 0.6x dcp.load's time", "ratio %s" % _f(x),
        None if x is None else x <= 0.6,
        "" if x is None or x <= 0.6 else "%.2fx the allowed time" % (x / 0.6))
    for key, c in (("load_ratio_vs_torch_mmap", "1p-fp32"),
                   ("load_ratio_vs_torch_mmap_bf16", "1p-bf16")):
        x = f[key]
        add("one-process cold load (%s) <= 0.8x torch.load(mmap=True) + copy_" % c,
            "ratio %s" % _f(x), None if x is None else x <= 0.8,
            "" if x is None or x <= 0.8 else "%.2fx the allowed time" % (x / 0.8))
    x = f["load_req_kib"]
    add("average device request during a strata load >= 2 MiB (/proc/diskstats, every "
        "process's reads on the device then; strata's own reads average %s KiB, O_DIRECT "
        "into huge pages: one request each up to the device's largest)"
        % _f(f["load_read_kib"], "%.0f"), "%s KiB" % _f(x, "%.0f"),
        None if x is None else x >= 2048,
        "" if x is None or x >= 2048 else "%.0f %% short" % ((2048 - x) / 2048 * 100))
    peak = agg.med(cfg, "strata_async", "peak_extra_save")
    pool = metas.get(cfg, [{}])[0].get("pool_bytes")
    add("peak extra memory during an async save <= the configured pool",
        "%s MiB vs pool %s MiB" % (_f(peak / MIB if peak is not None else None, "%.0f"),
                                   _f(pool / MIB if pool else None, "%.0f")),
        None if peak is None or not pool else peak <= pool,
        "" if peak is None or not pool or peak <= pool else "%.0f MiB over" % ((peak - pool) / MIB))
    x = f["peak_extra_ratio_vs_dcp"]
    add("peak extra memory during a load < 1/2 of DCP's", "ratio %s" % _f(x),
        None if x is None else x < 0.5, "")
    snap = agg.med(cfg, "strata_async", "snapshot_gbps")
    mc = agg.med(cfg, "env", "memcpy_gbps")
    x = _ratio(snap, mc)
    add("snapshot copy >= 0.8 of single-thread memcpy",
        "%s GB/s vs memcpy %s GB/s: %s" % (_f(snap), _f(mc), _f(x)),
        None if x is None else x >= 0.8,
        "" if x is None or x >= 0.8 else "%.0f %% short" % ((0.8 - x) / 0.8 * 100))
    for c in info["configs"]:
        if c.startswith("4p"):
            g = agg.med(c, "strata_load_4", "load_gbps")
            x = _ratio(g, disk_r)
            rd = agg.med(c, "strata_load_4", "storage_read")
            add("load on 4 processes (%s) >= 0.9 of the disk's read rate" % c,
                "%s (storage read on the node: %s MiB for a %s MiB state)" % (
                    _f(x), _f(rd / MIB if rd is not None else None, "%.0f"),
                    _f(metas[c][0]["bytes"] / MIB, "%.0f")),
                None if x is None else x >= 0.9,
                "" if x is None or x >= 0.9 else "%.0f %% short" % ((0.9 - x) / 0.9 * 100))
    return out


def ratio_rows(info, agg):
    """Every figure: strata beside DCP's best and torch.save."""
    out = []
    for cfg in info["configs"]:
        save_fig = [("stall in the loop (s)", "stall_s", DCP_ASYNC, "strata_async"),
                    ("blocked in the loop (s)", "blocked_s", DCP_ASYNC, "strata_async"),
                    ("time to durable, async (s)", "durable_s", DCP_ASYNC, "strata_async"),
                    ("time to durable in the loop (s)", "loop_durable_s", DCP_ASYNC,
                     "strata_async"),
                    ("snapshot (s)", "snapshot_s", DCP_ASYNC, "strata_async"),
                    ("peak extra RSS, async save (MiB)", "peak_extra_save", DCP_ASYNC,
                     "strata_async"),
                    ("blocking save (s)", "durable_s", DCP_SAVE, "strata_save"),
                    ("peak extra RSS, blocking save (MiB)", "peak_extra_save", DCP_SAVE,
                     "strata_save")]
        for label, metric, dcps, mine in save_fig:
            sv = agg.med(cfg, mine, metric)
            if sv is None:
                continue
            ds, dv = _best(agg, cfg, dcps, metric)
            tv = agg.med(cfg, "torch_save", metric) if metric in (
                "durable_s", "peak_extra_save", "stall_s", "blocked_s", "loop_durable_s") else None
            out.append((cfg, label, mine, sv, ds, dv, _ratio(sv, dv), tv, _ratio(sv, tv),
                        metric))
        loads = [("cold load (s)", "load_s"), ("peak extra RSS, load (MiB)", "peak_extra_load")]
        pairs = [("strata_load", "dcp_load", "torch_load_mmap"),
                 ("strata_load_4", "dcp_load_4", None), ("strata_load_3", "dcp_load_3", None),
                 ("strata_load_1", "dcp_load_1", None)]
        for label, metric in loads:
            for mine, d, t in pairs:
                sv = agg.med(cfg, mine, metric)
                if sv is None:
                    continue
                dv = agg.med(cfg, d, metric)
                tv = agg.med(cfg, t, metric) if t else None
                out.append((cfg, label, mine, sv, d, dv, _ratio(sv, dv), tv, _ratio(sv, tv),
                            metric))
    return out


def _mib(metric):
    return metric.startswith("peak") or metric in ("storage_read", "shm_bytes",
                                                   "strata_all_bytes")


def write(info, metas, rows, out_dir):
    agg = Agg(rows)
    f, dcp_stall, dcp_dur, disk_w, disk_r = figures(info, agg)
    line = " ".join("%s=%s" % (k, _f(v, "%.3f")) for k, v in f.items())
    md = []
    w = md.append
    w("# bench-torch: strata beside torch.save and DCP in a training loop")
    w("")
    w("`make bench-torch`, %s UTC, %.0f s. Medians of %d rounds (min-max in brackets); the "
      "systems' order rotates each round. Ratios are strata's time or memory over the other's "
      "(lower is better) unless said otherwise." % (
          datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"), info["seconds"], info["rounds"]))
    w("")
    w("## Setup")
    w("")
    m = info["machine"]
    v = info["versions"]
    w("- Machine: %s, %s cores, %.0f GiB RAM, kernel %s; checkpoints on %s." % (
        m.get("cpu", "?"), m.get("cores"), m.get("mem_gib", 0), m.get("kernel"), m.get("fs", "?")))
    w("- Versions: python %s, torch %s, strata %s, numpy %s, matplotlib %s, %s." % (
        v.get("python"), v.get("torch"), v.get("strata"), v.get("numpy"), v.get("matplotlib"),
        v.get("fio")))
    ps = ["%s: CPU %s %%, I/O %s %%" % (c, agg.cell(c, "env", "psi_cpu", "%.0f"),
                                         agg.cell(c, "env", "psi_io", "%.0f"))
          for c in info["configs"] if agg.vals(c, "env", "psi_cpu")]
    if ps:
        w("- The machine is shared: the share of each phase's time in which some task waited "
          "for a CPU or for I/O (Linux PSI 'some', all users of the machine): %s." % "; ".join(ps))
    if info.get("note"):
        w("- %s" % info["note"])
    w("- Page cache dropped before every load (`echo 3 > /proc/sys/vm/drop_caches`): %s." % (
        "yes" if info["drop_caches"] else "**NOT permitted here: loads are not cold**"))
    la = ["%s %s" % (c, agg.cell(c, "env", "loadavg", "%.1f")) for c in info["configs"]
          if agg.vals(c, "env", "loadavg")]
    if la:
        w("- Load average (1 min) at the end of each phase: %s." % "; ".join(la))
    w("- **Disk, as strata uses it** (the reference of every \"of disk\" figure below; `strata "
      "bench disk`: O_DIRECT, 4 threads, 8 MiB writes and fsync, then cold reads of a load's "
      "size, %d MiB, each round) through strata's I/O buffers (%s): write %s GB/s, cold read "
      "%s GB/s, at %s / %s KiB per device request. The same through buffers of 4 KiB pages: "
      "write %s GB/s, read %s GB/s, at %s / %s KiB per request." % (
          info["size_mb"], info.get("disk_pages", "?"), agg.cell("env", "disk", "write_gbps"),
          agg.cell("env", "disk", "read_gbps"), agg.cell("env", "disk", "write_req_kib", "%.0f"),
          agg.cell("env", "disk", "read_req_kib", "%.0f"),
          agg.cell("env", "disk4k", "write_gbps"), agg.cell("env", "disk4k", "read_gbps"),
          agg.cell("env", "disk4k", "write_req_kib", "%.0f"),
          agg.cell("env", "disk4k", "read_req_kib", "%.0f")))
    w("- Disk by fio (its own buffers: 4 KiB pages; O_DIRECT, 8 MiB blocks, libaio queue "
      "depth 4, %d MiB, fsync at the end, each round): write %s GB/s, cold read %s GB/s." % (
          info["size_mb"], agg.cell("env", "fio", "write_gbps"),
          agg.cell("env", "fio", "read_gbps")))
    for cfg in info["configs"]:
        mm = metas.get(cfg)
        if not mm:
            continue
        m0 = mm[0]
        extra = ""
        if cfg.startswith("1p"):
            extra = ("; K = %d steps per checkpoint; %d torch threads; memcpy (1 thread, 1 GiB) %s GB/s; copy_ of the whole "
                     "state into ready tensors %s s (%s GB/s)" % (
                         m0.get("k", 0), m0.get("torch_threads", 0),
                         agg.cell(cfg, "env", "memcpy_gbps", "%.2f"),
                         agg.cell(cfg, "env", "copy_s"), agg.cell(cfg, "env", "copy_gbps",
                                                                   "%.2f")))
        else:
            extra = ("; 4 gloo ranks (1 torch thread each), FSDP2 x TP on a 2 x 2 mesh, "
                     "placements %s; %s MiB per rank" % (
                         ", ".join(m0.get("placements", [])),
                         "/".join("%.0f" % (x / MIB) for x in m0.get("local", []))))
        w("- **%s**: GPT-style, %d blocks of width 1024, vocab 16384; state (parameters + "
          "AdamW exp_avg, exp_avg_sq) %.0f MiB%s; strata pool %d MiB (per rank)." % (
              cfg, m0["layers"], m0["bytes"] / MIB, extra, m0.get("pool_bytes", 0) >> 20))
    w("- The loop (one process, where K > 0): forward, cross-entropy, backward, fused AdamW "
      "step, grads zeroed in place, on 1 x 16 tokens. An async system's period is one "
      "checkpoint then K steps (wait_snapshot / staging before the first optimizer step; "
      "durable waited for at the end of the period, where the next checkpoint would wait); a "
      "blocking save's is the save then 2 steps (that save is also the one whose call time "
      "and memory are reported). Three periods of K steps without checkpoints per round, "
      "spread through the rotation, give the step time (their median / K). **stall** = "
      "period - its steps x the step time; **blocked** = time inside the checkpoint calls and "
      "waits; **overhead** = stall / (K x the step time), i.e. with a checkpoint every K "
      "steps.")
    w("- Outside the loop, each system's first save after its setup (pools and stagers made "
      "and warmed at setup) gives the call, snapshot and durable times and the peak extra "
      "RSS (VmHWM above the RSS before the setup, pools and staging copies included; with 4 "
      "ranks the sum over ranks). Loads go into the training state, zeroed first, in place, "
      "then a digest of every tensor is compared with the saved state's (column ok).")
    m1 = metas.get(PRIMARY, [{}])[0]
    if m1.get("staging_probe"):
        w("- DCP StagingOptions flags alone on this CPU-only machine: %s. The stager "
          "configurations benchmarked combine the flags that work." % "; ".join(
              "`%s`: %s" % (n, r.replace("\n", " ")) for n, r in m1["staging_probe"]))
    opts = {}
    for cfg in info["configs"]:
        for mm in metas.get(cfg, []):
            opts.update(mm.get("options", {}))
    labels = {}
    for cfg in info["configs"]:
        for mm in metas.get(cfg, []):
            labels.update(mm.get("labels", {}))
    w("")
    w("Systems and options:")
    w("")
    for s in SAVE_ORDER:
        if s in opts:
            w("- `%s` (%s): %s" % (s, labels.get(s, s), opts[s]))
    w("")
    for cfg in info["configs"]:
        w("## %s: saves" % cfg)
        w("")
        loop = bool(agg.vals(cfg, "baseline", "period_s"))
        hdr = ["system"]
        if loop:
            hdr += ["stall (s)", "blocked (s)", "overhead %", "durable in loop (s)"]
        hdr += ["call (s)", "snapshot (s)", "durable (s)", "save GB/s", "of disk write",
                "snapshot GB/s", "peak extra (MiB)"]
        w("| " + " | ".join(hdr) + " |")
        w("|" + "---|" * len(hdr))
        if loop:
            w("| (no checkpoint: a period of %d steps takes) | %s |" % (
                metas[cfg][0].get("k", 0), agg.cell(cfg, "baseline", "period_s"))
              + " |" * (len(hdr) - 2))
        for s in SAVE_ORDER:
            if not agg.vals(cfg, s, "durable_s"):
                continue
            c = [labels.get(s, s)]
            if loop:
                c += [agg.cell(cfg, s, "stall_s"), agg.cell(cfg, s, "blocked_s"),
                      agg.cell(cfg, s, "overhead_pct", "%.1f"),
                      agg.cell(cfg, s, "loop_durable_s")]
            sg = agg.med(cfg, s, "save_gbps")
            mc = agg.med(cfg, "env", "memcpy_gbps")
            c += [agg.cell(cfg, s, "call_s"), agg.cell(cfg, s, "snapshot_s"),
                  agg.cell(cfg, s, "durable_s"), agg.cell(cfg, s, "save_gbps", "%.2f"),
                  _f(_ratio(sg, disk_w)), agg.cell(cfg, s, "snapshot_gbps", "%.2f"),
                  agg.cell(cfg, s, "peak_extra_save", "%.0f", 1.0 / MIB)]
            w("| " + " | ".join(c) + " |")
        shm = agg.med(cfg, "strata_mgr", "shm_bytes")
        if shm:
            w("")
            w("The manager's /dev/shm tier holds a further %.0f MiB of host memory (tmpfs, not "
              "in the process's RSS)." % (shm / MIB))
        w("")
        w("## %s: loads (cold)" % cfg)
        w("")
        hdr = ["load", "time (s)", "GB/s", "of disk read", "peak extra (MiB)",
               "read from storage on the node (MiB)", "the rank reading most (MiB)",
               "strata's bytes read, all ranks (MiB)", "KiB per device request", "ok"]
        w("| " + " | ".join(hdr) + " |")
        w("|" + "---|" * len(hdr))
        for s in LOAD_ORDER:
            if not agg.vals(cfg, s, "load_s"):
                continue
            ok = agg.vals(cfg, s, "ok")
            c = [LOAD_LABEL.get(s, s), agg.cell(cfg, s, "load_s"),
                 agg.cell(cfg, s, "load_gbps", "%.2f"),
                 _f(_ratio(agg.med(cfg, s, "load_gbps"), disk_r)),
                 agg.cell(cfg, s, "peak_extra_load", "%.0f", 1.0 / MIB),
                 agg.cell(cfg, s, "storage_read", "%.0f", 1.0 / MIB),
                 agg.cell(cfg, s, "storage_read_rank_max", "%.0f", 1.0 / MIB),
                 agg.cell(cfg, s, "strata_all_bytes", "%.0f", 1.0 / MIB),
                 agg.cell(cfg, s, "req_kib", "%.0f"),
                 "%d/%d" % (sum(ok), len(ok))]
            w("| " + " | ".join(c) + " |")
        w("")
    w("## Goals")
    w("")
    w("Figures of %s unless the goal names another configuration; disk rates are the medians "
      "of this run's `strata bench disk` through strata's I/O buffers (above)." % PRIMARY)
    w("")
    w("| goal | measured | | short by |")
    w("|---|---|---|---|")
    for g, meas, ok, note in goals(info, metas, agg, f, dcp_stall, dcp_dur, disk_w, disk_r):
        w("| %s | %s | %s | %s |" % (g, meas, ok, note))
    w("")
    w("## Ratios")
    w("")
    w("strata against DCP's best configuration for the figure (lowest median) and against "
      "torch.save / torch.load(mmap=True); lower is better.")
    w("")
    w("| config | figure | strata | value | DCP (best) | value | strata/DCP | torch | "
      "strata/torch |")
    w("|---|---|---|---|---|---|---|---|---|")
    for cfg, label, mine, sv, ds, dv, rd, tv, rt, metric in ratio_rows(info, agg):
        sc = 1.0 / MIB if _mib(metric) else 1.0
        fmt = "%.0f" if _mib(metric) else "%.3f"
        w("| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            cfg, label, mine, _f(sv * sc, fmt), ds or "-",
            _f(dv * sc if dv is not None else None, fmt), _f(rd),
            _f(tv * sc if tv is not None else None, fmt), _f(rt)))
    w("")
    w("Last line:")
    w("")
    w("```")
    w(line)
    w("```")
    w("")
    with open(os.path.join(out_dir, "torch.md"), "w") as fh:
        fh.write("\n".join(md))
    chart(info, metas, agg, labels, os.path.join(out_dir, "torch.png"))
    return line


LOAD_LABEL = {
    "torch_load": "torch.load + copy_",
    "torch_load_mmap": "torch.load(mmap=True) + copy_",
    "dcp_load": "DCP load",
    "strata_load": "strata load",
    "strata_mgr_load": "strata manager load (/dev/shm tier)",
    "dcp_load_4": "DCP 4 -> 4",
    "strata_load_4": "strata 4 -> 4",
    "dcp_load_3": "DCP 4 -> 3 (FSDP2)",
    "strata_load_3": "strata 4 -> 3 (FSDP2)",
    "dcp_load_1": "DCP 4 -> 1 (plain)",
    "strata_load_1": "strata 4 -> 1 (plain)",
}


def chart(info, metas, agg, labels, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("stall per checkpoint in the loop (s)", "stall_s", SAVE_ORDER, 1.0),
              ("time to durable from the call (s)", "durable_s", SAVE_ORDER, 1.0),
              ("cold load time (s)", "load_s", LOAD_ORDER, 1.0),
              ("peak extra host memory (MiB)", "peak_extra", SAVE_ORDER + LOAD_ORDER, 1.0 / MIB)]
    cfgs = info["configs"]
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"]
    fig, axes = plt.subplots(2, 2, figsize=(17, 12))
    for ax, (title, metric, systems, scale) in zip(axes.flat, panels):
        entries = []
        for s in systems:
            for i, c in enumerate(cfgs):
                mt = metric
                if metric == "peak_extra":
                    mt = "peak_extra_load" if s in LOAD_ORDER else "peak_extra_save"
                xs = agg.vals(c, s, mt)
                if xs:
                    entries.append((s, i, c, xs))
        names = []
        for s, _, _, _ in entries:
            if s not in names:
                names.append(s)
        width = 0.8 / max(len(cfgs), 1)
        for s, i, c, xs in entries:
            x = names.index(s) + (i - (len(cfgs) - 1) / 2) * width
            m = statistics.median(xs) * scale
            lo, hi = min(xs) * scale, max(xs) * scale
            mine = s.startswith("strata")
            ax.bar(x, m, width, color=colors[i % len(colors)], edgecolor="black" if mine else
                   "none", linewidth=1.5 if mine else 0,
                   yerr=[[m - lo], [hi - m]], capsize=2, label=c)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([LOAD_LABEL.get(n) or labels.get(n, n) for n in names], rotation=60,
                           ha="right", fontsize=8)
        ax.set_title(title)
        ax.axhline(0, color="grey", linewidth=0.5)
        h, lab = ax.get_legend_handles_labels()
        uniq = dict(zip(lab, h))
        ax.legend(uniq.values(), uniq.keys(), fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    sizes = ", ".join("%s %.2f GiB" % (c, metas[c][0]["bytes"] / 2**30) for c in cfgs if metas.get(c))
    fig.suptitle("strata vs DCP vs torch.save, state %s: medians of %d rounds (min-max "
                 "bars); strata outlined" % (sizes, info["rounds"]))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
