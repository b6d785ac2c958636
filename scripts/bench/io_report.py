"""The summary of scripts/bench/bench_io.py: medians per case, throughput
against the best raw figure, the ratios to DeepSpeed's AIO, the checksums'
price ([Note: the checksum's price]) and the verdict against the targets."""

from __future__ import annotations

import statistics
from typing import Optional

MiB = 1 << 20
# Figures judged against the targets: write_over has the store take the sums,
# write_over_sums gets them from the producer, as the optimizer's write-back does.
TARGET_METRICS = ("write_fresh", "write_over", "write_over_sums", "read", "read_plain", "write_plain")


def checksum_price(med: dict, default: str) -> Optional[dict]:
    """[Note: the checksum's price] figures from the medians (GB/s): the
    default store with and without checksums, and the CRC32C pass alone;
    printed, and returned for the JSON (None when not measured)."""
    on, off = med.get(default), med.get(default + "-nosum")
    if not on or not off or "crc_pass" not in off:
        return None
    u, k = off["write_over"], off["crc_pass"]
    p = {"overwrite_unchecked": u, "crc_pass": k, "serial_model": 1 / (1 / u + 1 / k),
         "overwrite_store_sums": on["write_over"], "overwrite_producer_sums": on.get("write_over_sums"),
         "fresh_unchecked": off["write_fresh"], "fresh_store_sums": on["write_fresh"]}
    print(f"\nThe checksums' price ({default}, GB/s): overwrites without checksums {u:.2f}, a CRC32C pass alone "
          f"{k:.2f}; the two one after the other would give {p['serial_model']:.2f}. With the store's sums "
          f"{on['write_over']:.2f} ({on['write_over'] / u:.2f} of unchecked, {on['write_over'] / p['serial_model']:.2f} "
          f"of the serial model)"
          + (f", with the producer's {p['overwrite_producer_sums']:.2f} ({p['overwrite_producer_sums'] / u:.2f})"
             if p["overwrite_producer_sums"] else "")
          + f". Fresh writes: {on['write_fresh']:.2f} with sums, {off['write_fresh']:.2f} without "
          f"({on['write_fresh'] / off['write_fresh']:.2f}).")
    return {k2: round(v, 3) for k2, v in p.items() if v is not None}


def summarize(samples: dict) -> tuple:
    """(medians, best raw figure per metric, ratios to it, paired ratios on the same extents)."""
    med = {c: {m: statistics.median(v) for m, v in ms.items()} for c, ms in samples.items()}
    best_raw = {}
    for c, ms in med.items():
        if c.startswith("raw/"):
            for m, v in ms.items():
                best_raw[m] = max(best_raw.get(m, 0.0), v)
    # Plain-tensor transfers are compared with the raw figure of the same direction.
    ref = {"write_fresh": "write_fresh", "write_over": "write_over", "write_over_sums": "write_over", "read": "read",
           "read_plain": "read", "write_plain": "write_over"}
    ratios = {c: {m: round(v / best_raw[ref[m]], 3) for m, v in ms.items() if ref.get(m) in best_raw}
              for c, ms in med.items() if not c.startswith("raw/")}
    # Paired: the store against raw O_DIRECT on its own extents, run just before
    # it (same file, region and data freshness; median of per-round ratios).
    paired = {}
    for c, ms in samples.items():
        for m in ("read", "write", "write_sums", "write_plain"):
            a, b = ms.get(f"{m}_same"), ms.get(f"raw_same_{m}")
            if a and b:
                paired.setdefault(c, {})[m] = round(statistics.median(x / y for x, y in zip(a, b)), 3)
    return med, best_raw, ratios, paired


def print_throughput(med: dict, ratios: dict, paired: dict, rounds: int, size: int) -> None:
    metrics = ["write_fresh", "write_over", "write_over_sums", "read", "read_plain", "write_plain"]
    print(f"\nSequential throughput, GB/s (median of {rounds}; {size // MiB} MiB per transfer; "
          f"ratio to the best raw figure in brackets)")
    print(f"{'case':42s}" + "".join(f"{m:>18s}" for m in metrics))
    for c in med:
        row = f"{c:42s}"
        for m in metrics:
            v = med[c].get(m)
            if v is None:
                row += f"{'-':>18s}"
            elif c.startswith("raw/"):
                row += f"{v:18.2f}"
            else:
                row += f"{v:10.2f} ({ratios[c][m]:.2f})"
        print(row)
    print("\nPaired with raw O_DIRECT on the store's own extents (same file, region and data freshness): "
          "store / raw, median of per-round ratios")
    for c, ms in paired.items():
        print(f"{c:42s}" + "".join(f"{m:>13s} {v:.2f}" for m, v in ms.items()))


def deepspeed_ratios(med: dict) -> dict:
    """Each store case / DeepSpeed AIO in the same run, printed where measured."""
    vs_ds = {}
    for c, ms in med.items():
        if c.startswith("store/"):
            for m, ref_case, ref_m in (("write_fresh", "locked", "write_fresh"), ("write_over", "locked", "write_over"),
                                       ("write_over_sums", "locked", "write_over"),
                                       ("read", "locked", "read"), ("read_plain", "plain", "read"),
                                       ("write_plain", "plain", "write_over")):
                d = med.get(f"deepspeed-aio/bs1M-qd32-t2-{ref_case}", {}).get(ref_m)
                if d and m in ms:
                    vs_ds.setdefault(c, {})[m] = round(ms[m] / d, 2)
    if vs_ds:
        print("\nAgainst DeepSpeed AIO in the same run (store / DeepSpeed; pool buffers against its locked "
              "tensors, plain tensors against plain tensors)")
        for c, ms in vs_ds.items():
            print(f"{c:42s}" + "".join(f"{m:>12s} {v:.2f}" for m, v in ms.items()))
    return vs_ds


def judge(ratios: dict, vs_ds: dict, paired: dict, default: str) -> tuple:
    """(targets, checks, the noise-floor case or None), printed.

    The targets, judged on the store as the engine configures it (Config's
    defaults: io_uring, 8 MiB blocks, queue depth 16, one path): the issue's
    (against the best raw figure and DeepSpeed's AIO), then stricter checks
    of our own (against raw O_DIRECT on the same extents, just before)."""
    rep = next((c for c in ratios if c.startswith("repeat/")), None)  # [Note: the noise floor]
    verdict, extra = {}, {}
    if default in ratios:
        thp = default + "-thp"  # plain tensors from torch's allocator with THP_MEM_ALLOC_ENABLE=1 (docs/io.md)
        groups = [
            (f"Targets ({default}): >= 0.90 of the best raw figure; >= 1.0 of DeepSpeed AIO where measured", verdict,
             [(f"{m} / best raw", ratios[default].get(m), 0.9) for m in TARGET_METRICS]
             + [(f"{m} / DeepSpeed AIO", vs_ds.get(default, {}).get(m), 1.0) for m in TARGET_METRICS]),
            ("Checks beyond the targets: >= 0.90 of raw O_DIRECT on the same extents, measured just before", extra,
             [(f"{m} / raw same extents", paired.get(default, {}).get(m), 0.9)
              for m in ("read", "write", "write_sums", "write_plain")]
             + [("write_plain (torch THP) / raw same extents", paired.get(thp, {}).get("write_plain"), 0.9)]),
        ]
        for title, into, checks in groups:
            print(f"\n{title}")
            for name, v, need in checks:
                if v is not None:
                    into[name] = {"ratio": v, "target": need, "met": v >= need}
                    print(f"  {name:42s} {v:6.2f}  {'met' if v >= need else 'MISSED'} (>= {need})")
        if rep:
            print(f"  noise floor ({rep[7:]} measured again in each round, / best raw): "
                  + ", ".join(f"{m} {v:.2f}" for m, v in ratios[rep].items()))
    return verdict, extra, rep
