"""NVFP4 packing, ModelOpt 0.47's E2M1 cast against the launcher's (``modelopt_nvfp4_fast_cast``),
side by side on the same weights, in one process:

    .venv/bin/python benchmarks/export_pack.py                      # CPU: where ModelOpt's exporter packs
    .venv/bin/python benchmarks/export_pack.py --device cuda --out $OUT/export_pack.json

For each of ``--shapes`` (default: a Nano-width expert's up and down projections, 3712 x 2688 and
2688 x 1856, and an attention projection 4096 x 2688) a bf16 weight of N(0, 0.02) is packed to
NVFP4 by ``NVFP4QTensor.quantize`` (block 16: scales, division, E2M1 cast, nibble packing), the
call ModelOpt's Megatron exporter makes per weight, first with ModelOpt's cast, then with the fast
one, ``--repeats`` times each (median); and the E2M1 cast alone (the profile's hotspot) on the same
weight scaled into E2M1's range.  Prints per shape both times, the ratios and whether the packed
bytes and scales are identical (they must be), and the parameters/s of each.  The export profile that
asked for this: benchmarks/results/2026-12-06-h100-nano-width-profile.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import log, markdown_table, write_json  # noqa: E402


def pack_times(w, repeats: int, sync) -> tuple[float, object]:
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    times, out = [], None
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        out = NVFP4QTensor.quantize(w, 16)
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def cast_time(cast, scaled, repeats: int, sync) -> float:
    """Median seconds of ``cast`` (which makes its input absolute in place: a fresh copy each time)."""
    times = []
    for _ in range(repeats):
        x = scaled.clone()
        sync()
        t = time.perf_counter()
        cast(x)
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--shapes", default="3712x2688,2688x1856,4096x2688")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="also write the results as JSON")
    args = ap.parse_args(argv)
    import torch

    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    from launcher.megatron import patches
    from launcher.megatron.modelopt_fixes import cast_fp4

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rows, results = [], []
    for spec in args.shapes.split(","):
        rows_n, cols_n = (int(v) for v in spec.split("x"))
        w = (torch.randn(rows_n, cols_n, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16().to(args.device)
        patches.undo("modelopt_nvfp4_fast_cast")
        theirs_s, theirs = pack_times(w, args.repeats, sync)
        assert patches.apply("modelopt_nvfp4_fast_cast")
        ours_s, ours = pack_times(w, args.repeats, sync)
        patches.undo("modelopt_nvfp4_fast_cast")
        scaled = w.float() * 300          # E2M1's range: the cast alone, the profile's hotspot
        cast_theirs = cast_time(lambda x: NVFP4QTensor._cast_fp4(x), scaled, args.repeats, sync)
        cast_ours = cast_time(cast_fp4, scaled, args.repeats, sync)
        same = (torch.equal(ours[0]._quantized_data, theirs[0]._quantized_data)
                and torch.equal(ours[1].view(torch.uint8), theirs[1].view(torch.uint8)) and torch.equal(ours[2], theirs[2]))
        r = {"shape": spec, "params": w.numel(), "modelopt_s": theirs_s, "fast_s": ours_s,
             "ratio": theirs_s / ours_s, "identical": same,
             "cast_modelopt_s": cast_theirs, "cast_fast_s": cast_ours, "cast_ratio": cast_theirs / cast_ours,
             "modelopt_params_per_s": w.numel() / theirs_s, "fast_params_per_s": w.numel() / ours_s}
        results.append(r)
        rows.append([spec, f"{cast_theirs * 1e3:.1f}", f"{cast_ours * 1e3:.1f}", f"{r['cast_ratio']:.2f}x",
                     f"{theirs_s * 1e3:.1f}", f"{ours_s * 1e3:.1f}", f"{r['ratio']:.2f}x",
                     f"{r['modelopt_params_per_s'] / 1e6:.0f}", f"{r['fast_params_per_s'] / 1e6:.0f}", same])
        log(f"{spec}: ModelOpt {theirs_s * 1e3:.1f} ms, fast {ours_s * 1e3:.1f} ms ({r['ratio']:.2f}x), identical {same}")
    print(markdown_table(["shape", "cast: ModelOpt ms", "cast: fast ms", "cast ratio", "pack: ModelOpt ms",
                          "pack: fast ms", "pack ratio", "ModelOpt M params/s", "fast M params/s",
                          "identical bytes"], rows))
    if args.out:
        write_json(args.out, {"benchmark": "export_pack", "device": args.device, "torch_threads": torch.get_num_threads(),
                              "results": results})
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
