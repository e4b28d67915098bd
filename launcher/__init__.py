"""PTQ pipeline launcher: quantize -> MMLU gate -> export -> vLLM smoke."""
__version__ = "0.1.0"
