"""MMLU gate: data sources, lm-eval prompts, batching, EP-safe shard plans, desync guard, gate.

Pure Python (no torch import):
    data.load_mmlu(source, split="test", subjects=None) -> list[Question]
    data.load_dev(dataset, dev_dataset=None) -> list[Question]
    data.check_source(path, key="stages.mmlu.dataset") -> "hf_dir"|"csv_dir"|"jsonl"|"hub"
    prompts.select_fraction(questions, fraction, seed=None); prompts.build_prompts(qs, dev, k)
    prompts.choice_token_ids(tokenizer); prompts.encode_prompts(prompts, tok, add_bos, max_seq_len)
    prompts.encode_texts(tok, texts) (batched); prompts.finish_ids(ids, bos, max_seq_len)
    token_cache.prompts_and_ids(dataset, dev, fraction, shots, tok, cache_root) -> prompts, ids, info
    batching.resolve_limits(batch_size, max_batch_tokens, device, ...) -> BatchLimits ("auto")
    batching.make_batches(lengths, rows, max_batch_tokens, min_fill) / make_batches_for(lengths, limits)
    batching.padding_efficiency(batches)
    sharding.plan_shards(shapes, dims, mode, dispatcher, allow_unsafe) -> ShardPlan
    sharding.resolve_mode(mode, ep, allow_unsafe)
    gate.wilson_interval(correct, n); gate.decide(...) -> GateDecision; gate.check_gate_config(...)
    results.Prediction / results.Evaluation; results.decide(prepared, results, scfg, baseline) -> GateDecision;
    results.build_results(...) -> mmlu/results.json
Torch side:
    guard.StepGuard / guard.make_groups / guard.DesyncError (exit code ExitCode.DESYNC)
    evaluate.run_plan / evaluate.evaluate_model / evaluate.gather_to_rank0 / evaluate.batch_limits
    evaluate.prepare_model_for_eval (fold weight quantizers, grouped experts) / release_model_after_eval
The stage itself is ``launcher.stages.mmlu`` (``run``); ``prepared.prepare`` readies the questions.
"""
