"""One model of ``benchmarks/mmlu_gpu.py``: every evaluator configuration on the same questions.

``bench_model`` builds two copies of one random model with the same weights: the gate's
(``build_model(..., eval_kernels=True)``) and the reference kernels' (the local spec, as the
quantize stage builds it and as ``megatron_mmlu`` users run it).  Then, each run timed between
``sync()`` calls after warm-up, on the questions ``launcher.mmlu.prepared.prepare`` selected:

* ``old_default``   the gate before issue 16: 8 rows, no budget, reference kernels, expert loop;
* ``default``       the product default: ``batch_size: auto`` (``batch_limits``), eval kernels,
                    folded + grouped experts (``prepare_model_for_eval``);
* ``budget:N``      the same at other token budgets (fill cut 0.8), and ``256:16384`` (the
                    previous best explicit setting); ``best`` is the fastest of these and ``default``;
* ``local_kernels`` / ``expert_loop``  the default without eval kernels / without grouping;
* ``nvfp4`` / ``fp8``  the model quantized in place (ModelOpt, max calibration on packed MMLU
                    prompts): ``*_unfolded`` (weight quantizers every forward, expert loop) and
                    ``*`` (the gate: folded + grouped), at the default limits;
* ``reference bs=N`` ``megatron_mmlu`` on the reference-kernel bf16 model.
"""
from __future__ import annotations

import dataclasses
import os
import time

from benchmarks._common import log, read_jsonl, write_model_dir
from benchmarks._gpu_profile import profile_call
from benchmarks._mmlu_reference import ref_prompt, ref_selection, run_reference

PEAK_DATASHEET = 989e12
PEAK_MEASURED = 790e12
QUANT_RECIPES = {"nvfp4": "NVFP4_DEFAULT_CFG", "fp8": "FP8_DEFAULT_CFG"}


def margin(vals) -> float:
    s = sorted(vals, reverse=True)
    return s[0] - s[1]


def compare(a: dict, b: dict, tie_eps: float, subset=None) -> dict:
    """Prediction agreement of two runs; 'changed_clear': differing where both top-2 margins > tie_eps.
    'changes' lists changed questions (every clear one, then others up to 20): the top-2 margin
    in both runs and the max |logit diff|.  ``subset``: only these questions."""
    keys = sorted(k for k in a if subset is None or k in subset)
    diff = [k for k in keys if a[k][0] != b[k][0]]
    clear = [k for k in diff if margin(a[k][1]) > tie_eps and margin(b[k][1]) > tie_eps]
    per_q = {k: max(abs(x - y) for x, y in zip(a[k][1], b[k][1])) for k in keys}
    return {"n": len(keys), "same": len(keys) - len(diff), "changed": len(diff), "changed_clear": len(clear),
            "max_abs_logit_diff": max(per_q.values()),
            "median_abs_logit_diff": sorted(per_q.values())[len(keys) // 2],
            "bit_identical": all(a[k][1] == b[k][1] for k in keys),
            "changes": [{"question": k, "margins": [round(margin(a[k][1]), 4), round(margin(b[k][1]), 4)],
                         "max_abs_logit_diff": round(per_q[k], 4)}
                        for k in (clear + [k for k in diff if k not in clear])[:max(20, len(clear))]]}


class ModelBench:
    def __init__(self, name, cfg, args, tokenizer, work, fl):
        import torch

        self.name, self.cfg, self.args, self.tokenizer, self.fl = name, cfg, args, tokenizer, fl
        self.cuda = args.device == "cuda"
        self.torch = torch
        self.runs: list[dict] = []
        self.preds: dict[str, dict] = {}
        self.hf = write_model_dir(os.path.join(work, name), cfg, args.tokenizer)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def build(self, eval_kernels: bool):
        from launcher.megatron.models import build_model
        from launcher.topology import ParallelDims

        return build_model(self.hf, ParallelDims(world_size=1), self.args.device, "bfloat16", "alltoall",
                           eval_kernels=eval_kernels)

    def warm(self, model):
        from launcher.megatron.forward import forward_logits

        pad = int(self.prepared.pad_id)
        for rows, seq in ((1, 64), (8, 256), (4, max(self.lengths))):
            toks = self.torch.full((rows, seq), pad, dtype=self.torch.long)
            forward_logits(model, toks, positions=self.torch.full((rows,), seq - 1, dtype=self.torch.long))
        self.sync()

    def evaluate(self, label: str, model, limits, kind: str, steady: bool = True, **extra) -> dict | None:
        """Time one evaluation.  ``steady``: an untimed pass over the same batches first (JIT
        compiles, kernel selection, allocator growth for these shapes), its time kept as
        ``first_seconds``; else one pass, timed."""
        from launcher.mmlu.batching import make_batches_for, padding_efficiency
        from launcher.mmlu.evaluate import evaluate_model
        from launcher.topology import ParallelDims

        batches = make_batches_for(self.lengths, limits)
        prep = dataclasses.replace(self.prepared, batches=batches)
        times = []
        try:
            for _ in range(2 if steady else 1):
                self.sync()
                t = time.perf_counter()
                res, _, _ = evaluate_model(model, prep, ParallelDims(world_size=1), 0, "auto", "alltoall",
                                           timeout_s=600)
                self.sync()
                times.append(time.perf_counter() - t)
        except self.torch.OutOfMemoryError as e:
            log(f"{self.name}: {label}: out of memory ({str(e).splitlines()[0][:120]}); skipped")
            self.torch.cuda.empty_cache()
            return None
        sec = times[-1]
        extra["first_seconds"] = times[0]
        n = len(self.lengths)
        executed = sum(self.fl.executed(b.padded_len, 1) * b.rows for b in batches)
        entry = {"config": label, "kind": kind, "limits": limits.summary(), "batches": len(batches),
                 "seconds": sec, "questions_per_s": n / sec, "tokens_per_s_real": self.real_tokens / sec,
                 "padding_efficiency": padding_efficiency(batches),
                 "mfu_datasheet": self.useful / sec / PEAK_DATASHEET, "mfu_measured_peak": self.useful / sec / PEAK_MEASURED,
                 "hfu_padded_datasheet": executed / sec / PEAK_DATASHEET, **extra}
        self.runs.append(entry)
        self.preds[label] = {self.prepared.prompts[i].question.index: res[i] for i in range(n)}
        if self.cuda:
            self.torch.cuda.empty_cache()
        log(f"{self.name}: {label}: {sec:.3f} s, {len(batches)} batches, {n / sec:.1f} q/s, MFU {entry['mfu_datasheet']:.3f}")
        return entry

    def profile(self, label: str, model, limits) -> dict:
        """One forward of the largest batch of ``limits`` under the profiler."""
        from launcher.megatron.forward import forward_logits
        from launcher.mmlu.batching import make_batches_for

        b = max(make_batches_for(self.lengths, limits), key=lambda x: x.padded_tokens)
        toks = self.torch.full((b.rows, b.padded_len), int(self.prepared.pad_id), dtype=self.torch.long)
        last = self.torch.zeros(b.rows, dtype=self.torch.long)
        for row, p in enumerate(b.items):
            ids = self.prepared.token_ids[p]
            toks[row, :len(ids)] = self.torch.tensor(ids)
            last[row] = len(ids) - 1
        try:
            forward_logits(model, toks, positions=last)
            prof = profile_call(lambda: forward_logits(model, toks, positions=last), self.sync, self.cuda)
        except Exception as e:   # a profiler failure must not lose the timings
            log(f"{self.name}: profile {label} failed: {type(e).__name__}: {e}")
            return {"config": label, "shape": [b.rows, b.padded_len], "error": f"{type(e).__name__}: {e}"[:500]}
        prof.update(config=label, shape=[b.rows, b.padded_len])
        return prof

    def quantize(self, model, recipe: str):
        import modelopt.torch.quantization as mtq

        from launcher.megatron.forward import forward_logits
        from launcher.megatron.models import unwrap_model
        from launcher.quant.calibration import pack_tokens

        samples = pack_tokens(self.prepared.token_ids[:256], self.args.calib_samples, 512, int(self.prepared.pad_id))
        batches = [self.torch.tensor(samples[i:i + 4]) for i in range(0, len(samples), 4)]
        t = time.perf_counter()
        mtq.quantize(unwrap_model(model), getattr(mtq, recipe), lambda _m: [forward_logits(model, x) for x in batches])
        self.sync()
        return time.perf_counter() - t

    def run(self) -> dict:
        from omegaconf import OmegaConf

        from launcher.schema import MmluStage
        from launcher.mmlu.batching import AUTO_MIN_FILL, BatchLimits
        from launcher.mmlu.evaluate import prepare_model_for_eval, release_model_after_eval
        from launcher.mmlu.evaluate import batch_limits
        from launcher.mmlu.prepared import prepare

        args, name = self.args, self.name
        fraction = args.moe_fraction if name == "moe" else args.fraction
        t = time.perf_counter()
        ref_model = self.build(eval_kernels=False)
        model = self.build(eval_kernels=True)
        model.load_state_dict(ref_model.state_dict())
        self.sync()
        build_s = time.perf_counter() - t
        log(f"{name}: built both models in {build_s:.1f} s; {self.fl.n_total / 1e9:.3f} B params")

        scfg = OmegaConf.merge(OmegaConf.structured(MmluStage(dataset=args.dataset)),
                               {"fraction": fraction, "few_shots": 0})
        cache = os.path.join(args.work, f"token-cache-{name}")   # cold = a miss for each model
        limits = batch_limits(scfg, args.device, self.hf)
        timing = {}
        for phase in ("cold", "warm"):     # cold: cache miss (batched encoding); warm: cache hit
            t = time.perf_counter()
            self.prepared = prepare(scfg, self.tokenizer, limits, cache_root=cache)
            timing[f"prepare_{phase}_s"] = time.perf_counter() - t
            timing[f"cache_{phase}"] = self.prepared.token_cache["cache"]
        self.lengths = [len(x) for x in self.prepared.token_ids]
        self.real_tokens = sum(self.lengths)
        self.useful = sum(self.fl.useful(s) for s in self.lengths)
        n = len(self.lengths)
        log(f"{name}: {n} questions, {self.real_tokens} tokens; prepare cold {timing['prepare_cold_s']:.3f} s "
            f"warm {timing['prepare_warm_s']:.3f} s; default limits {limits.summary()}")
        self.warm(ref_model)
        self.warm(model)

        old = BatchLimits(8, None, None, "explicit")
        self.evaluate("old_default", ref_model, old, "bf16", steady=False)
        report = prepare_model_for_eval(model)
        self.evaluate("default", model, limits, "bf16", eval_model=report)
        for b in args.budgets:
            self.evaluate(f"budget:{b}", model, BatchLimits(None, b, AUTO_MIN_FILL, "sweep"), "bf16")
        self.evaluate("256:16384", model, BatchLimits(256, 16384, None, "explicit"), "bf16")
        profiles = [self.profile("default", model, limits)]
        prepare_model_for_eval(ref_model)
        self.evaluate("local_kernels", ref_model, limits, "ablation")
        profiles.append(self.profile("local_kernels", ref_model, limits))
        release_model_after_eval(ref_model)
        if "num_experts" in self.cfg:
            release_model_after_eval(model)
            self.evaluate("expert_loop", model, limits, "ablation", steady=False)
            profiles.append(self.profile("expert_loop", model, limits))

        refs = self.reference(ref_model, fraction)
        quant = {}
        for fmt in args.quant:
            release_model_after_eval(model)
            if fmt != args.quant[0]:
                import gc

                del model
                gc.collect()
                if self.cuda:
                    self.torch.cuda.empty_cache()
                model = self.build(eval_kernels=True)
                model.load_state_dict(ref_model.state_dict())
            q_s = self.quantize(model, QUANT_RECIPES[fmt])
            self.warm(model)
            self.evaluate(f"{fmt}_unfolded", model, limits, "quantized", steady=False)
            folded = None
            if "num_experts" in self.cfg:   # attribution: fold alone, expert loop kept
                from launcher.megatron.fold import fold_weight_quantizers

                folded = fold_weight_quantizers(model)["folded"]
                self.evaluate(f"{fmt}_folded_loop", model, limits, "attribution", steady=False)
            rep = prepare_model_for_eval(model)
            self.warm(model)
            self.evaluate(fmt, model, limits, "quantized", eval_model=rep, calibrate_s=q_s)
            # noise floor: the same gate at another budget (other shapes, other GEMM tilings)
            self.evaluate(f"{fmt}@16384", model, BatchLimits(None, 16384, AUTO_MIN_FILL, "sweep"),
                          "attribution", steady=False)
            profiles.append(self.profile(fmt, model, limits))
            quant[fmt] = {"calibrate_s": q_s, "fold": rep,
                          "folded_weight_quantizers": rep["folded_weight_quantizers"] if folded is None else folded}
        del model, ref_model
        if self.cuda:
            self.torch.cuda.empty_cache()
        return self.summarize(timing, refs, quant, profiles, build_s, limits, fraction)

    def reference(self, ref_model, fraction) -> list[dict]:
        args = self.args
        rows_all = read_jsonl(args.dataset)
        sel = ref_selection(rows_all, fraction)
        if sel != [p.question.index for p in self.prepared.prompts]:
            raise AssertionError(f"{self.name}: the reference selects other questions than ours")
        ref_ids = [self.tokenizer(ref_prompt(rows_all[i])).input_ids for i in sel]
        ref_lengths = [len(x) for x in ref_ids]
        # the reference keeps the question text unstripped: some prompts differ by a token
        self.same_tokens = {i for i, x, y in zip(sel, ref_ids, self.prepared.token_ids) if list(x) == list(y)}
        order = sorted(range(len(sel)), key=lambda i: ref_lengths[i], reverse=True)
        out = []
        for bs in args.ref_batch_sizes:
            try:
                r = run_reference(ref_model, self.tokenizer, fraction, bs, self.prepared.choice_ids, self.sync,
                                  not self.cuda, args.mmlu_hf)
            except self.torch.OutOfMemoryError:
                log(f"{self.name}: reference bs={bs}: out of memory; skipped")
                self.torch.cuda.empty_cache()
                continue
            preds, k = {}, 0
            for c in r["choice"]:
                for row in range(c.shape[0]):
                    p = order[k]
                    vals = c[row, ref_lengths[p] - 1]
                    preds[sel[p]] = (int(vals.argmax()), vals.tolist())
                    k += 1
            acc = sum(preds[i][0] == int(rows_all[i]["answer"]) for i in sel) / len(sel)
            if k != len(sel) or abs(acc - r["accuracy"]) > 1e-6:
                raise AssertionError(f"reference bs={bs}: rebuilt predictions do not match its accuracy")
            ref_useful = sum(self.fl.useful(s) for s in ref_lengths)
            out.append({"batch_size": bs, "seconds": r["total_s"], "loop_s": r["loop_s"], "calls": r["calls"],
                        "questions_per_s": len(sel) / r["total_s"], "accuracy": r["accuracy"],
                        "tokens_per_s_real": sum(ref_lengths) / r["total_s"],
                        "mfu_datasheet": ref_useful / r["total_s"] / PEAK_DATASHEET})
            self.preds[f"reference:{bs}"] = preds
            log(f"{self.name}: reference bs={bs}: {r['total_s']:.2f} s (loop {r['loop_s']:.2f} s)")
        return out

    def summarize(self, timing, refs, quant, profiles, build_s, limits, fraction) -> dict:
        runs = {r["config"]: r for r in self.runs}
        tie = self.args.tie_eps
        default = runs["default"]
        product = [r for r in self.runs if r["kind"] == "bf16" and r["config"] != "old_default"]
        best = min(product, key=lambda r: r["seconds"])
        ref_best = min(refs, key=lambda r: r["seconds"]) if refs else None
        ref_bs1 = next((r for r in refs if r["batch_size"] == 1), None)
        e2e = timing["prepare_warm_s"] + default["seconds"]
        first_best = min(product, key=lambda r: r["first_seconds"])
        ratios = {"default_over_best": default["seconds"] / best["seconds"],
                  "default_over_best_first_pass": default["first_seconds"] / first_best["first_seconds"],
                  "default_first_pass_over_steady": default["first_seconds"] / default["seconds"],
                  "prepare_warm_over_eval": timing["prepare_warm_s"] / default["seconds"],
                  "prepare_cold_over_eval": timing["prepare_cold_s"] / default["seconds"],
                  "old_default_over_default": runs["old_default"]["seconds"] / default["seconds"]}
        if ref_best:
            ratios.update(ref_best_over_default_e2e=ref_best["seconds"] / e2e,
                          ref_best_over_default_e2e_cold=ref_best["seconds"] / (timing["prepare_cold_s"] + default["seconds"]),
                          ref_best_over_best=ref_best["seconds"] / best["seconds"],
                          ref_best_over_default_e2e_first_pass=ref_best["seconds"] / (timing["prepare_warm_s"]
                                                                                       + default["first_seconds"]))
        if ref_bs1:
            ratios["ref_bs1_over_default_e2e"] = ref_bs1["seconds"] / e2e
        for fmt in quant:
            if fmt in runs:
                ratios[f"{fmt}_over_bf16_default"] = runs[fmt]["seconds"] / default["seconds"]
                ratios[f"{fmt}_unfolded_over_bf16_default"] = runs[f"{fmt}_unfolded"]["seconds"] / default["seconds"]
        agreement = {"default_vs_old_default": compare(self.preds["default"], self.preds["old_default"], tie),
                     "default_vs_local_kernels": compare(self.preds["default"], self.preds["local_kernels"], tie)}
        if "expert_loop" in self.preds:
            agreement["grouped_vs_expert_loop"] = compare(self.preds["default"], self.preds["expert_loop"], tie)
        for fmt in quant:
            pairs = {f"{fmt}_folded_grouped_vs_unfolded_loop": (fmt, f"{fmt}_unfolded"),
                     f"{fmt}_fold_only": (f"{fmt}_folded_loop", f"{fmt}_unfolded"),
                     f"{fmt}_grouping_only": (fmt, f"{fmt}_folded_loop"),
                     f"{fmt}_noise_floor_other_budget": (fmt, f"{fmt}@16384")}
            for key, (x, y) in pairs.items():
                if x in self.preds and y in self.preds:
                    agreement[key] = compare(self.preds[x], self.preds[y], tie)
        if ref_best:
            ours_b, ref_b = self.preds[best["config"]], self.preds[f"reference:{ref_best['batch_size']}"]
            agreement["best_vs_reference_best"] = compare(ours_b, ref_b, tie)
            agreement["best_vs_reference_best_same_prompt_tokens"] = compare(ours_b, ref_b, tie, self.same_tokens)
        return {"model": self.name, "config": self.cfg, "params_total": self.fl.n_total,
                "params_active_matmul": self.fl.n_active, "fraction": fraction, "questions": len(self.lengths),
                "prompt_tokens": self.real_tokens, "max_prompt_tokens": max(self.lengths), "build_s": build_s,
                "default_limits": limits.summary(), **timing, "ours": self.runs, "ours_default": default,
                "ours_best": best, "reference": refs, "reference_best": ref_best, "quantized": quant,
                "ratios": ratios, "agreement": agreement, "profiles": profiles}
