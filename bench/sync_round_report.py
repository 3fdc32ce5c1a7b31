#!/usr/bin/python3
"""Formats bench/sync_round.sh's raw results as markdown tables.

usage: sync_round_report.py RAW_TSV REDUCER_JSON HEADER_TXT
RAW_TSV lines: KIND<TAB>key=value key=value ...  with KIND one of
  loopback  (loopback_bw's RESULT), peer (the peer script's line),
  grid / rss (sync_bench's RESULT).
REDUCER_JSON (reducer_bench --benchmark_out, may be missing) and HEADER_TXT
(the run's description) are optional inputs.
"""
import json
import os
import sys

MIB = 1024 * 1024


def parse(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            kind, _, rest = line.partition("\t")
            d = {}
            for tok in rest.split():
                k, sep, v = tok.partition("=")
                if sep:
                    d[k] = v
            rows.append((kind, d))
    return rows


def fmt(x, digits=3):
    if x is None:
        return "-"
    return f"{x:.{digits}f}"


def verdict(ok):
    if ok is None:
        return "n/a"
    return "met" if ok else "NOT met"


def main():
    raw, reducer_json, header = sys.argv[1], sys.argv[2], sys.argv[3]
    rows = parse(raw)
    out = []
    if os.path.exists(header):
        with open(header) as f:
            out += [line.rstrip("\n") for line in f]
        out.append("")

    loopback = {}  # streams -> GB/s
    for kind, d in rows:
        if kind == "loopback":
            loopback[int(d["streams"])] = float(d["GBps"])
    if loopback:
        out.append("Loopback TCP (loopback_bw): " + ", ".join(
            f"{s} stream{'s' if s > 1 else ''} {g:.2f} GB/s"
            for s, g in sorted(loopback.items())))
        out.append("")

    def bandwidth(world):
        """Bytes/s for the lower bound: the best of 1 and `world` streams."""
        cands = [loopback.get(1), loopback.get(world)]
        cands = [c for c in cands if c]
        return max(cands) * 1e9 if cands else None

    peer_by = {}  # (world, params) -> median s
    for kind, d in rows:
        if kind == "peer":
            peer_by[(int(d["world"]), int(d["params"]))] = float(d["median_s"])

    grid = [d for kind, d in rows if kind == "grid"]
    targets = {}
    if grid:
        out.append("## Sync round: localsgd vs accelerate LocalSGD on gloo")
        out.append("")
        out.append("| world | params (M) | wire | ours median s | ours min s "
                   "| peer median s | ours/peer | wire MB per worker per round "
                   "| coordinator peak RSS MiB | lower bound s "
                   "| ours/lower bound | late-joiner fetch GB/s |")
        out.append("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for d in grid:
            world, params = int(d["world"]), int(d["params"])
            ours = float(d["median_s"])
            per_worker = int(d["bytes_sent"]) + int(d["bytes_received"])
            p = peer_by.get((world, params))
            ratio = ours / p if p else None
            bw = bandwidth(world)
            lower = world * per_worker / bw if bw else None
            hwm = int(d["coordinator_hwm_kib"])
            rss = hwm / 1024 if hwm >= 0 else None
            fetch = float(d.get("fetch_GBps", "0")) or None
            out.append(
                f"| {world} | {params / 1e6:g} | {d['wire']} | {fmt(ours)} "
                f"| {fmt(float(d['min_s']))} | {fmt(p)} | {fmt(ratio, 2)} "
                f"| {per_worker / 1e6:.1f} | {fmt(rss, 1)} | {fmt(lower)} "
                f"| {fmt(ours / lower if lower else None, 2)} "
                f"| {fmt(fetch, 2)} |")
            if world == 4 and params == 25_000_000:
                targets[d["wire"]] = dict(ratio=ratio, lb=(ours / lower if lower else None),
                                          fetch=fetch, rss=rss, params=params)
        out.append("")
        out.append("Peer: fp32 only; bf16 rows compare with the same peer fp32 "
                   "figure. Lower bound: WORLD x (bytes sent + received per "
                   "worker) / the best loopback bandwidth of 1 and WORLD streams.")
        out.append("")

    rss_rows = [d for kind, d in rows if kind == "rss"]
    rss_values = []
    if rss_rows:
        out.append("## Coordinator peak RSS against the number of workers (fp32, ours only)")
        out.append("")
        out.append("| world | params (M) | coordinator peak RSS MiB "
                   "| target MiB (2.5 x model + 64) | within target "
                   "| ours median s |")
        out.append("|---:|---:|---:|---:|---|---:|")
        for d in rss_rows:
            params = int(d["params"])
            hwm = int(d["coordinator_hwm_kib"])
            rss = hwm / 1024 if hwm >= 0 else None
            target = (2.5 * params * 4 + 64 * MIB) / MIB
            if rss is not None:
                rss_values.append((rss, target))
            out.append(f"| {d['world']} | {params / 1e6:g} | {fmt(rss, 1)} "
                       f"| {target:.1f} | {verdict(rss <= target if rss else None)} "
                       f"| {fmt(float(d['median_s']))} |")
        if len(rss_values) > 1:
            lo = min(r for r, _ in rss_values)
            hi = max(r for r, _ in rss_values)
            out.append("")
            out.append(f"Spread over the worlds: {lo:.1f} to {hi:.1f} MiB "
                       f"(max/min {hi / lo:.2f}).")
        out.append("")

    reducer_ratios = []
    if os.path.exists(reducer_json):
        with open(reducer_json) as f:
            bench = json.load(f)
        by_name = {}
        for b in bench.get("benchmarks", []):
            if b.get("run_type", "iteration") != "iteration":
                continue
            by_name[b["name"]] = float(b["bytes_per_second"])
        # Bytes per element each kernel's bytes/s counts (see reducer_bench.cc).
        kernels = [("AccumulateFp32", 4, True), ("AccumulateFp32Weighted", 4, True),
                   ("AccumulateBf16", 2, True), ("AccumulateBf16Weighted", 2, True),
                   ("FinalizeFp32", 4, True), ("FinalizeBf16", 4, True),
                   ("EncodeBf16", 4, False), ("DecodeBf16", 4, False)]
        out.append("## Reducer kernels (reducer_bench, CPU time) against memcpy of the same bytes")
        out.append("")
        out.append("| kernel | chunk elements | bytes counted | GB/s | memcpy GB/s "
                   "| ratio | elements/s vs memcpy of the fp32 chunk |")
        out.append("|---|---:|---|---:|---:|---:|---:|")
        for name, width, in_target in kernels:
            for n in (256 * 1024, 1024 * 1024):
                k = by_name.get(f"BM_{name}/{n}")
                m = by_name.get(f"BM_Memcpy/{width * n}")
                if k is None or m is None:
                    continue
                ratio = k / m
                # The same elements/s against memcpy of n fp32 values (4n
                # bytes): the kernel's throughput in model parameters.
                m4 = by_name.get(f"BM_Memcpy/{4 * n}")
                per_elem = (k / width) * 4 / m4 if m4 else None
                if in_target:
                    reducer_ratios.append((name, n, ratio))
                what = {2: "bf16 payload", 4: "fp32 payload"}[width]
                if name.startswith("Finalize"):
                    what = "fp32 accumulator"
                elif name.startswith(("Encode", "Decode")):
                    what = "fp32 values"
                elem = f"{per_elem:.0%}" if per_elem else "-"
                out.append(f"| {name} | {n // 1024}Ki | {what} | {k / 1e9:.2f} "
                           f"| {m / 1e9:.2f} | {ratio:.0%} | {elem} |")
        out.append("")
        out.append("Finalize has no standalone function in src/: it is the loop "
                   "Job::CloseRoundLocked runs (DivideInPlace per chunk, then "
                   "RoundTripInPlace for the wire dtype).")
        out.append("")

    # The sync-round targets.
    out.append("## Targets (WORLD=4, 25M)")
    out.append("")
    f32, b16 = targets.get("float32", {}), targets.get("bfloat16", {})
    lines = [
        ("fp32 ours/peer <= 0.7", f32.get("ratio"), lambda v: v <= 0.7),
        ("bf16 ours/peer <= 0.4", b16.get("ratio"), lambda v: v <= 0.4),
        ("fp32 round <= 1.5 x lower bound", f32.get("lb"), lambda v: v <= 1.5),
        ("bf16 round <= 1.5 x lower bound", b16.get("lb"), lambda v: v <= 1.5),
        ("late joiner fetch (fp32, 100 MB) >= 2 GB/s", f32.get("fetch"), lambda v: v >= 2),
    ]
    for what, v, ok in lines:
        out.append(f"- {what}: {fmt(v, 2)} — {verdict(ok(v) if v is not None else None)}")
    if rss_values:
        within = all(r <= t for r, t in rss_values)
        lo, hi = min(r for r, _ in rss_values), max(r for r, _ in rss_values)
        out.append(f"- coordinator peak RSS <= 2.5 x model + 64 MiB at every world: "
                   f"{lo:.1f}..{hi:.1f} MiB vs {rss_values[0][1]:.1f} — {verdict(within)}")
    else:
        out.append("- coordinator peak RSS flat 4..32 workers: n/a (no RSS rows; "
                   "the full run has them)")
    if reducer_ratios:
        worst = min(reducer_ratios, key=lambda x: x[2])
        for prefix in ("AccumulateFp32", "AccumulateBf16"):
            rs = [r for name, _, r in reducer_ratios if name.startswith(prefix)]
            if rs:
                out.append(f"- reducer {prefix} >= 70% of memcpy: worst "
                           f"{min(rs):.0%} — {verdict(min(rs) >= 0.7)}")
        out.append(f"  (worst of all reducer kernels incl. finalize: {worst[0]}/"
                   f"{worst[1] // 1024}Ki at {worst[2]:.0%})")
    print("\n".join(out))


if __name__ == "__main__":
    main()
