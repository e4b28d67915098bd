import sys, time, torch
from dataclasses import replace
from launcher.tiny.synthetic_mmlu import TaskGenerator
from launcher.tiny.tokenizer import train_tokenizer
from launcher.tiny.train import Recipe, make_config, train, score
kw = eval("dict(" + (sys.argv[1] if len(sys.argv)>1 else "") + ")")
r = replace(Recipe(), **kw)
torch.set_num_threads(r.threads); torch.manual_seed(r.seed)
t0=time.time()
task = TaskGenerator(r.seed, r.n_test, r.n_dev_per_subject, r.n_invented)
tok = train_tokenizer(task.corpus(r.tokenizer_corpus_prompts), r.tokenizer_vocab)
task = TaskGenerator(r.seed, r.n_test, r.n_dev_per_subject, r.n_invented)
from transformers import Qwen3MoeForCausalLM
cfg = make_config(r, tok)
m = Qwen3MoeForCausalLM(cfg)
print("params", sum(p.numel() for p in m.parameters()), "setup", time.time()-t0, flush=True)
train(m, tok, task, r)
t1=time.time()
acc,_ = score(m, tok, task.test)
dev = {}
for d in task.dev: dev.setdefault(d["subject"], []).append(d)
acc5,_ = score(m, tok, task.test, dev, 5)
print("acc", acc, "acc5", acc5, "eval", time.time()-t1, "total", time.time()-t0)
