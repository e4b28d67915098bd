"""vLLM smoke test support: capability check, server / offline engine, client, verdicts.

Nothing here imports vLLM: it runs out of process in its own interpreter (.venv-vllm by
default, ``stages.vllm_smoke.python`` otherwise).

    capability.py     pure: what the export is (read_quant_info) x what vLLM offers -> decide
    probe.py          which interpreter; ask it (subprocess) for vLLM's version, build, GPUs
    backends.py       the Backend protocol: ServerBackend, OfflineBackend (what the stage calls)
    server.py         VllmServer (OpenAI server, /health, stop), run_offline (offline engine)
    offline_engine.py the standalone offline script run in the vLLM interpreter
    procs.py          process-group start/stop, log tail, error line
    client.py         urllib client: /health, /v1/models, /v1/completions (choice logprobs, greedy)
    gate_questions.py the gate's questions rebuilt from mmlu/results.json + stages.mmlu (token ids)
    agreement.py      pure: choice scores, agreement with the gate, the choice verdict
    generation.py     generation checks (jsonl, chat template) and their verdict
    prompts/          shipped generation checks (general.jsonl: "The capital of France is" -> Paris)
"""
