import sys, os, time, torch
from dataclasses import replace
import launcher.tiny.synthetic_mmlu as sm
from launcher.tiny.tokenizer import train_tokenizer
from launcher.tiny.train import Recipe, make_config, train, score
kw = eval("dict(" + (sys.argv[1] if len(sys.argv)>1 else "") + ")")
only = os.environ.get("ONLY")
if only:
    orig = sm.build_facts
    def bf(seed, n):
        fs = orig(seed, n)
        if only == "word_identity":
            words = sorted({f.answer for f in fs if f.subject in ("word_opposites", "creature_colors", "fictional_geography")})
            return [sm.Fact("word_identity", f"Which word is {w}?", w, tuple(x for x in words if x != w), w) for w in words]
        return [f for f in fs if f.subject == only]
    sm.build_facts = bf
    sm.SUBJECTS = (only,)
r = replace(Recipe(), **kw)
torch.set_num_threads(r.threads); torch.manual_seed(r.seed)
t0=time.time()
task = sm.TaskGenerator(r.seed, r.n_test, r.n_dev_per_subject, r.n_invented)
tok = train_tokenizer(task.corpus(r.tokenizer_corpus_prompts), r.tokenizer_vocab)
task = sm.TaskGenerator(r.seed, r.n_test, r.n_dev_per_subject, r.n_invented)
from transformers import Qwen3MoeForCausalLM
m = Qwen3MoeForCausalLM(make_config(r, tok))
print("params", sum(p.numel() for p in m.parameters()), "setup", time.time()-t0, flush=True)
train(m, tok, task, r)
t1=time.time()
acc,_ = score(m, tok, task.test)
print("acc", acc, "total", time.time()-t0)
