"""The CPU NVFP4 fake quantization (``cpu_compat.nvfp4_fake_quant_cpu``) against ModelOpt's
quantize/dequantize (``nvfp4_fake_quant_reference``, what it replaced), side by side in one process:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/nvfp4_fake_quant.py [--out .bench/results/nvfp4_fake_quant.json]

For each of ``--shapes`` (default: the SmolLM2-135M gate's operands - a 2048-token activation of
width 576 and of width 1536, and the 1536 x 576 / 576 x 1536 MLP weights) an fp32 N(0, 1) tensor is
fake-quantized with block 16 and a calibrated amax (4.0: some blocks saturate), ``--repeats`` times
each way, alternating (median).  Prints both times, the ratio and whether the outputs are identical
bit for bit (they must be: the script fails otherwise).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import log, markdown_table, write_json  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="2048x576,2048x1536,1536x576,576x1536")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", help="also write the results as JSON")
    args = ap.parse_args(argv)
    import torch

    from launcher.megatron.cpu_compat import nvfp4_fake_quant_cpu, nvfp4_fake_quant_reference

    amax = torch.tensor(4.0)
    rows, results = [], []
    for spec in args.shapes.split(","):
        shape = tuple(int(v) for v in spec.split("x"))
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        times = {"reference": [], "fast": []}
        outs = {}
        for _ in range(args.repeats):
            for name, fn in (("reference", nvfp4_fake_quant_reference), ("fast", nvfp4_fake_quant_cpu)):
                t = time.perf_counter()
                outs[name] = fn(x, 16, amax)
                times[name].append(time.perf_counter() - t)
        ref_s, fast_s = statistics.median(times["reference"]), statistics.median(times["fast"])
        same = torch.equal(outs["fast"].view(torch.int32), outs["reference"].view(torch.int32))
        r = {"shape": spec, "elements": x.numel(), "reference_s": ref_s, "fast_s": fast_s,
             "ratio": ref_s / fast_s, "identical_bits": same}
        results.append(r)
        rows.append([spec, f"{ref_s * 1e3:.1f}", f"{fast_s * 1e3:.1f}", f"{r['ratio']:.2f}x", same])
        log(f"{spec}: reference {ref_s * 1e3:.1f} ms, fast {fast_s * 1e3:.1f} ms ({r['ratio']:.2f}x), identical {same}")
    print(markdown_table(["shape", "ModelOpt reference ms", "fast ms", "ratio", "identical bits"], rows))
    if args.out:
        write_json(args.out, {"benchmark": "nvfp4_fake_quant", "torch_threads": torch.get_num_threads(),
                              "repeats": args.repeats, "results": results})
    return 0 if all(r["identical_bits"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
