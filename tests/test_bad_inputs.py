"""Issue 28: a corpus of bad inputs - config values, data files, recipes, config.json, paths, run
directories and exports.  Each is refused by `launch validate` (exit 2) before anything starts,
or, where only a verb can know (a run directory given to `launch status`, an export given to
`launch verify`), fails with a clear error.  Each entry states the exit code and a fragment of
the message that names the input (key and value, or file and line); no case prints a traceback.

The inputs live under tmp_path: a checkpoint directory holding only the tiny card's config.json,
a valid MMLU jsonl and a valid calibration jsonl (the base, which validates), then one bad input
per case.  Torch-free: `launch validate` reads these files itself.
"""
import json
import os

import pytest

from conftest import ROOT
from launcher.cli import main

TINY = os.path.join(ROOT, "examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml")
CONFIG_JSON = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 4,
               "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
               "num_experts_per_tok": 2, "vocab_size": 640, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def _q(i, subject="algebra", **kw):
    return {"question": f"q{i}", "subject": subject, "choices": ["a", "b", "c", "d"], "answer": i % 4, **kw}


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


class Inputs:
    """The base inputs under ``tmp``, and writers of bad ones."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.ckpt = self.checkpoint(CONFIG_JSON)
        self.mmlu = _jsonl(tmp / "mmlu.jsonl", [_q(i, s) for s in ("algebra", "biology") for i in range(3)])
        self.calib = _jsonl(tmp / "calib.jsonl", [{"text": f"calibration text {i}"} for i in range(20)])

    def checkpoint(self, config, name="ckpt"):
        d = self.tmp / name
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
        return str(d)

    def file(self, name, text=""):
        (self.tmp / name).write_text(text)
        return str(self.tmp / name)

    def dir(self, name):
        (self.tmp / name).mkdir(exist_ok=True)
        return str(self.tmp / name)

    def validate(self, *overrides):
        return ["validate", TINY, f"model.path={self.ckpt}", f"stages.mmlu.dataset={self.mmlu}",
                f"stages.quantize.calib.dataset={self.calib}", f"runs_root={self.tmp}/runs", *overrides]

    def recipe(self, text):
        path = self.file("recipe.yaml", text)
        return self.validate("recipe.modelopt_cfg=null", f"recipe.recipe_path={path}")

    def run_dir(self, metadata):
        d = self.dir("run")
        if metadata is not None:
            (self.tmp / "run" / "metadata.json").write_text(metadata)
        return ["status", d]


RECIPE_OK_HEAD = "metadata: {recipe_type: ptq}\nimports: {unit: configs/ptq/units/w4_nvfp4}\n"

# (id, argv builder, exit code, fragment: {tmp} is tmp_path)
CASES = [
    # -- config values: ranges, kinds of value, Enums -------------------------------------------------
    ("dtype-bf16", lambda i: i.validate("stages.quantize.dtype=bf16"), 2,
     "stages.quantize.dtype='bf16': valid: bfloat16, float16, float32"),
    ("export-dtype-fp8", lambda i: i.validate("stages.export.dtype=fp8"), 2,
     "stages.export.dtype='fp8': valid: bfloat16, float16, float32"),
    ("port-70000", lambda i: i.validate("executor.master_port=70000"), 2,
     "executor.master_port=70000: must be null or satisfy 1 <= master_port <= 65535"),
    ("timeout-0", lambda i: i.validate("executor.collective_timeout_s=0"), 2,
     "executor.collective_timeout_s=0: must be > 0"),
    ("vllm-startup-timeout-negative", lambda i: i.validate("stages.vllm_smoke.startup_timeout_s=-5"), 2,
     "stages.vllm_smoke.startup_timeout_s=-5: must be > 0"),
    ("vllm-nvfp4-kernels-bogus", lambda i: i.validate("stages.vllm_smoke.nvfp4_kernels=marlin"), 2,
     "stages.vllm_smoke.nvfp4_kernels='marlin': valid: auto, emulation"),
    ("vllm-nvfp4-emulation-on-fp8", lambda i: i.validate("recipe=fp8_default", "stages.vllm_smoke.enabled=true",
                                                         "stages.vllm_smoke.nvfp4_kernels=emulation"), 2,
     "stages.vllm_smoke.nvfp4_kernels='emulation': serves NVFP4 exports; recipe fp8_default exports fp8 "
     "(valid here: auto)"),
    ("calib-size-0", lambda i: i.validate("stages.quantize.calib.size=0"), 2,
     "stages.quantize.calib.size=0: must be >= 1"),
    ("fraction-0", lambda i: i.validate("stages.mmlu.fraction=0"), 2,
     "stages.mmlu.fraction=0.0: must satisfy 0 < fraction <= 1"),
    ("slurm-nodes-0", lambda i: i.validate("executor=slurm", "executor.nodes=0"), 2,
     "executor.nodes=0: must be >= 1"),
    ("slurm-poll-0", lambda i: i.validate("executor=slurm", "executor.poll_interval_s=0"), 2,
     "executor.poll_interval_s=0.0: must be > 0"),
    ("tp-0", lambda i: i.validate("stages.mmlu.parallel.tp=0"), 2, "stages.mmlu.parallel.tp=0: must be >= 1"),
    ("seed-negative", lambda i: i.validate("seed=-1"), 2, "seed=-1: must be >= 0"),
    ("both-recipe-keys", lambda i: i.validate("recipe.recipe_path=general/ptq/nvfp4_mlp_weight_only"), 2,
     "recipe 'nvfp4_default': set exactly one of recipe.modelopt_cfg and recipe.recipe_path"),
    ("job-name-space", lambda i: i.validate("job_name=my job"), 2, "job_name='my job': use letters, digits"),
    ("export-name-slash", lambda i: i.validate("stages.export.name=a/b"), 2,
     "stages.export.name='a/b': must be a plain directory name"),
    ("shard-mode-bogus", lambda i: i.validate("stages.mmlu.shard_mode=bogus"), 2,
     "stages.mmlu.shard_mode='bogus': valid: auto, balanced, lockstep, dense_dp"),
    ("slurm-time", lambda i: i.validate("executor=slurm", "executor.time=1h"), 2,
     "executor.time='1h': valid: minutes, MM:SS"),
    # -- paths of the wrong kind ------------------------------------------------------------------------
    ("runs-root-is-a-file", lambda i: i.validate(f"runs_root={i.file('afile')}"), 2,
     "runs_root='{tmp}/afile': is a file; valid: a directory (created when missing)"),
    ("runs-root-under-a-file", lambda i: i.validate(f"runs_root={i.file('afile')}/runs"), 2,
     "runs_root='{tmp}/afile/runs': cannot be created: {tmp}/afile is a file"),
    ("model-path-is-a-file", lambda i: i.validate(f"model.path={i.file('afile')}"), 2,
     "model.path='{tmp}/afile': is a file; valid: a directory"),
    ("mmlu-missing", lambda i: i.validate(f"stages.mmlu.dataset={i.tmp}/nope.jsonl"), 2,
     "stages.mmlu.dataset='{tmp}/nope.jsonl': path does not exist"),
    ("vllm-prompts-is-a-dir", lambda i: i.validate(f"stages.vllm_smoke.prompts={i.dir('adir')}"), 2,
     "stages.vllm_smoke.prompts='{tmp}/adir': is a directory; valid: a file"),
    ("baseline-cache-is-a-file", lambda i: i.validate(f"stages.mmlu.baseline_cache_dir={i.file('afile')}"), 2,
     "stages.mmlu.baseline_cache_dir='{tmp}/afile': is a file; valid: a directory"),
    ("calib-plain-dir", lambda i: i.validate(f"stages.quantize.calib.dataset={i.dir('adir')}"), 2,
     "stages.quantize.calib.dataset='{tmp}/adir': a directory without dataset_dict.json or state.json"),
    # -- MMLU data ----------------------------------------------------------------------------------------
    ("mmlu-malformed-line", lambda i: i.validate("stages.mmlu.dataset=" + _jsonl(
        i.tmp / "bad.jsonl", [_q(0), _q(1), '{"question": "q", "subject"'])), 2,
     "stages.mmlu.dataset='{tmp}/bad.jsonl': {tmp}/bad.jsonl:3: not JSON: "),
    ("mmlu-answer-7", lambda i: i.validate("stages.mmlu.dataset=" + _jsonl(i.tmp / "bad.jsonl", [_q(0), _q(1, answer=7)])),
     2, "stages.mmlu.dataset='{tmp}/bad.jsonl': {tmp}/bad.jsonl:2: answer=7 is not one of 0-3 or A-D"),
    ("mmlu-3-choices", lambda i: i.validate("stages.mmlu.dataset=" + _jsonl(
        i.tmp / "bad.jsonl", [_q(0, choices=["a", "b", "c"])])), 2,
     "stages.mmlu.dataset='{tmp}/bad.jsonl': {tmp}/bad.jsonl:1: expected 4 choices, got 3"),
    ("mmlu-no-subject", lambda i: i.validate("stages.mmlu.dataset=" + _jsonl(
        i.tmp / "bad.jsonl", [{k: v for k, v in _q(0).items() if k != "subject"}])), 2,
     "{tmp}/bad.jsonl:1: missing keys ['subject']"),
    ("mmlu-empty-question", lambda i: i.validate("stages.mmlu.dataset=" + _jsonl(i.tmp / "bad.jsonl", [_q(0, question="")])),
     2, "{tmp}/bad.jsonl:1: question=''; valid: a non-empty string"),
    ("mmlu-empty-file", lambda i: i.validate(f"stages.mmlu.dataset={i.file('empty.jsonl')}"), 2,
     "stages.mmlu.dataset='{tmp}/empty.jsonl': holds no questions"),
    ("mmlu-few-shots-short-dev", lambda i: i.validate(
        "stages.mmlu.few_shots=5", "stages.mmlu.dev_dataset=" + _jsonl(i.tmp / "dev.jsonl", [_q(0), _q(1, "biology")])),
     2, "stages.mmlu.few_shots=5: the dev split has only 1 question(s) for subject 'algebra'"),
    ("mmlu-csv-5-columns", lambda i: i.validate(f"stages.mmlu.dataset={_csv_dir(i.tmp)}"), 2,
     "{tmp}/csv/data/test/algebra_test.csv:2: expected 6 columns question,A,B,C,D,answer; got 5"),
    # -- calibration data ------------------------------------------------------------------------------
    ("calib-empty", lambda i: i.validate(f"stages.quantize.calib.dataset={i.file('calib0.jsonl')}"), 2,
     "stages.quantize.calib.dataset='{tmp}/calib0.jsonl': holds no calibration text"),
    ("calib-no-text-key", lambda i: i.validate("stages.quantize.calib.dataset=" + _jsonl(
        i.tmp / "c.jsonl", [{"body": "x"}] * 20)), 2,
     "{tmp}/c.jsonl:1: record has neither a string 'text' field (stages.quantize.calib.text_key) nor a 'messages' list "
     "(keys: ['body'])"),
    ("calib-too-few", lambda i: i.validate("stages.quantize.calib.dataset=" + _jsonl(
        i.tmp / "c.jsonl", [{"text": "a"}] * 3)), 2,
     "stages.quantize.calib.size=16: {tmp}/c.jsonl holds 3 calibration text(s)"),
    ("calib-malformed", lambda i: i.validate("stages.quantize.calib.dataset=" + _jsonl(
        i.tmp / "c.jsonl", [{"text": "a"}, "{oops"])), 2, "{tmp}/c.jsonl:2: not JSON: "),
    # -- recipes ----------------------------------------------------------------------------------------
    ("recipe-not-yaml", lambda i: i.recipe("a: [1, 2\n"), 2,
     "recipe.recipe_path='{tmp}/recipe.yaml': {tmp}/recipe.yaml:2: not YAML: expected ',' or ']'"),
    ("recipe-unknown-key", lambda i: i.recipe(RECIPE_OK_HEAD + "quantise: {}\nquantize: {quant_cfg: []}\n"), 2,
     "recipe.recipe_path='{tmp}/recipe.yaml': unknown key 'quantise'; valid keys: imports, metadata, quantize"),
    ("recipe-quant-cfg-str", lambda i: i.recipe(RECIPE_OK_HEAD + "quantize: {quant_cfg: '*weight*'}\n"), 2,
     "recipe.recipe_path='{tmp}/recipe.yaml': quantize.quant_cfg is a str; valid: a list"),
    ("recipe-entry-no-name", lambda i: i.recipe(RECIPE_OK_HEAD + "quantize:\n  quant_cfg:\n    - {enable: false}\n"), 2,
     "recipe.recipe_path='{tmp}/recipe.yaml': quantize.quant_cfg[0].quantizer_name=None; valid: a wildcard string"),
    ("recipe-import-undeclared", lambda i: i.recipe(RECIPE_OK_HEAD + "quantize:\n  quant_cfg:\n    - $import: nope\n"), 2,
     "quantize.quant_cfg[0]: $import 'nope' is not in imports (valid: unit)"),
    ("recipe-no-metadata", lambda i: i.recipe("quantize: {quant_cfg: []}\n"), 2,
     "recipe.recipe_path='{tmp}/recipe.yaml': metadata.recipe_type=None; valid: 'ptq'"),
    ("recipe-missing", lambda i: i.validate("recipe.modelopt_cfg=null", f"recipe.recipe_path={i.tmp}/nope.yaml"), 2,
     "recipe.recipe_path='{tmp}/nope.yaml': neither a file nor a ModelOpt built-in recipe"),
    # -- config.json -------------------------------------------------------------------------------------
    ("config-json-not-json", lambda i: i.validate(f"model.path={i.checkpoint('{bad', 'c2')}"), 2,
     "model.path='{tmp}/c2': {tmp}/c2/config.json is not valid JSON"),
    ("config-json-layers-str", lambda i: i.validate(f"model.path={i.checkpoint({**CONFIG_JSON, 'num_hidden_layers': '4'}, 'c2')}"),
     2, "model.path='{tmp}/c2': config.json num_hidden_layers='4'; valid: an integer >= 1"),
    ("config-json-architectures-str", lambda i: i.validate(
        f"model.path={i.checkpoint({**CONFIG_JSON, 'architectures': 'Qwen3MoeForCausalLM'}, 'c2')}"), 2,
     "config.json architectures='Qwen3MoeForCausalLM'; valid: a list of class names"),
    ("config-json-list", lambda i: i.validate(f"model.path={i.checkpoint('[1]', 'c2')}"), 2,
     "{tmp}/c2/config.json holds a JSON list; valid: a JSON object"),
    # -- run directories ---------------------------------------------------------------------------------
    ("status-not-a-run", lambda i: i.run_dir(None), 2, "launch: {tmp}/run: not a run directory (no metadata.json)"),
    ("status-metadata-not-json", lambda i: i.run_dir("{trunc"), 2, "launch: {tmp}/run/metadata.json: not valid JSON"),
    ("status-metadata-no-stages", lambda i: i.run_dir('{"run_id": "x", "job_name": "j"}'), 2,
     "launch: {tmp}/run/metadata.json: lacks 'stages' (a mapping)"),
    ("resume-not-a-run", lambda i: i.validate()[1:] + [f"--resume={i.dir('adir')}"], 2,
     "launch: --resume {tmp}/adir: not a run directory (no metadata.json)"),
    ("suite-no-examples", lambda i: ["suite", i.dir("adir")], 2, "launch: no example YAML under {tmp}/adir"),
    ("suite-test-level", lambda i: ["suite", i.dir("adir"), "--test-level", "two"], 2,
     "launch: --test-level two: valid: an integer >= 0"),
    # -- exports (launch verify) ---------------------------------------------------------------------------
    ("verify-missing", lambda i: ["verify", f"{i.tmp}/nope"], 2, "export directory '{tmp}/nope' does not exist"),
    ("verify-index-not-json", lambda i: ["verify", _export(i, {"model.safetensors.index.json": '{"weight_map": '})], 2,
     "{tmp}/export/model.safetensors.index.json: not valid JSON"),
    ("verify-quant-config-not-json", lambda i: ["verify", _export(i, {"hf_quant_config.json": "{"})], 2,
     "{tmp}/export/hf_quant_config.json: not a JSON object with quantization.quant_algo"),
    ("verify-truncated-safetensors", lambda i: ["verify", _export(i, {"model.safetensors": b"\x10" + b"\0" * 7 + b"{}"})], 2,
     "{tmp}/export/model.safetensors: corrupt safetensors header (claims 16 bytes, file has 10)"),
    ("verify-config-json-list", lambda i: ["verify", _export(i, {"config.json": "[1]"})], 1,
     "FAIL: config.json: holds a JSON list, not an object"),
    ("verify-config-json-not-json", lambda i: ["verify", _export(i, {"config.json": "{bad"})], 1,
     "FAIL: config.json: cannot read it (JSONDecodeError"),
]


def _csv_dir(tmp):
    d = tmp / "csv" / "data" / "test"
    d.mkdir(parents=True)
    (d / "algebra_test.csv").write_text("q1,a,b,c,d,A\nq2,a,b,c,D\n")
    return str(tmp / "csv")


def _export(inputs, files):
    d = inputs.tmp / "export"
    d.mkdir(exist_ok=True)
    for name, data in files.items():
        (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(d)


@pytest.fixture
def inputs(tmp_path):
    return Inputs(tmp_path)


@pytest.mark.parametrize("overrides", [[], ["recipe=none"], ["recipe=fp8_default"], ["recipe=nvfp4_mlp_weight_only"],
                                       ["executor=slurm"], ["stages.quantize.dtype=float16"]])
def test_the_base_inputs_validate(inputs, capsys, overrides):
    assert main(inputs.validate(*overrides)) == 0, capsys.readouterr().err


@pytest.mark.parametrize("build, code, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_input_is_refused_naming_it_without_a_traceback(inputs, capsys, build, code, fragment):
    rc = main(build(inputs))
    out, err = capsys.readouterr()
    assert rc == code, out + err
    assert fragment.format(tmp=inputs.tmp) in out + err, out + err
    assert "Traceback" not in out + err


def test_the_corpus_covers_every_kind_of_input():
    kinds = {c[0].split("-")[0] for c in CASES}
    assert len(CASES) >= 30 and {"mmlu", "calib", "recipe", "config", "status", "suite", "verify", "runs"} <= kinds


MMLU_TEST = os.path.join(os.path.dirname(ROOT), "shared", "data", "mmlu", "test.jsonl")


@pytest.mark.skipif(not os.path.isfile(MMLU_TEST), reason="the full MMLU test split is not on this machine")
def test_reading_the_full_mmlu_split_is_bounded():
    """What validate reads of the full split (14,042 questions) costs well under a second of CPU."""
    import time

    from launcher.mmlu.data import check_contents

    t = time.process_time()
    assert check_contents(MMLU_TEST, None, 0.01, 0) == []
    assert time.process_time() - t < 1.0


def test_report_user_error_prints_one_line_per_problem_and_logs_the_traceback(tmp_path, capsys):
    import sys

    from launcher.contract import UserError, report_user_error

    log = tmp_path / "log.txt"
    log.write_text("earlier\n")
    report_user_error("[mmlu r1]", UserError("a.b=1: must be >= 2\n  c='x': valid: y"), str(log),
                      "Traceback (most recent call last):\n  ...\n", sys.stderr)
    assert capsys.readouterr().err.splitlines() == ["[mmlu r1] STAGE FAILED: a.b=1: must be >= 2",
                                                    "[mmlu r1] STAGE FAILED: c='x': valid: y"]
    assert log.read_text() == ("earlier\n[mmlu r1] traceback of the error above (log only):\n"
                               "Traceback (most recent call last):\n  ...\n")


@pytest.mark.slow
def test_a_stage_that_meets_a_bad_data_file_fails_in_one_line_and_logs_the_traceback(tmp_path, tiny_dir):
    """Only the stage reads the file here (--no-check-paths): every rank that meets it prints one
    line naming the key and the line of the file; the traceback is in the stage's log only."""
    import subprocess
    import sys

    bad = _jsonl(tmp_path / "bad.jsonl", [_q(0), _q(1), '{"question": "q", "subject"'])
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", TINY, "--no-check-paths", "recipe=none", "stages.quantize.enabled=false",
         "stages.export.enabled=false", "stages.vllm_smoke.enabled=false", f"stages.mmlu.dataset={bad}",
         f"runs_root={tmp_path}/runs"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    failed = [line for line in out.splitlines() if "STAGE FAILED" in line]
    assert failed and all(line.endswith(f"STAGE FAILED: stages.mmlu.dataset={bad!r}: {bad}:3: not JSON: Expecting ':' "
                                        "delimiter: line 1 column 28 (char 27); valid: one JSON object a line")
                          for line in failed), out
    assert "Traceback" not in out
    (log,) = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "runs") for f in fs if f == "log.txt"]
    assert "traceback of the error above (log only):\nTraceback (most recent call last):" in open(log).read()


def test_an_hf_parquet_dataset_is_read_record_by_record(inputs, capsys):
    """The cais/mmlu parquet layout is read with pyarrow alone (no datasets import): a bad record is
    named by its split and index."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    root = inputs.tmp / "cais"
    (root / "all").mkdir(parents=True)
    rows = [_q(0), _q(1, answer=9)]
    pq.write_table(pa.Table.from_pylist(rows), str(root / "all" / "test-00000-of-00001.parquet"))
    assert main(inputs.validate(f"stages.mmlu.dataset={root}")) == 2
    err = capsys.readouterr().err
    assert f"stages.mmlu.dataset='{root}': {root}[test] record 1: answer=9 is not one of 0-3 or A-D" in err, err
    pq.write_table(pa.Table.from_pylist(rows[:1]), str(root / "all" / "test-00000-of-00001.parquet"))
    assert main(inputs.validate(f"stages.mmlu.dataset={root}")) == 0, capsys.readouterr().err
