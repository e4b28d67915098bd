"""`launch`: compose an example, validate it, plan it, run it.

    launch CONFIG [overrides...] [--dry-run [--json]] [--preflight] [--resume RUN_DIR] [--detach]
    launch validate CONFIG [overrides...]        compose + validate (no torch), exit 2 on errors
    launch status RUN_DIR                        per-stage state (metadata.json, Slurm when submitted)
    launch verify EXPORT_DIR [--recipe NAME] [--source HF_DIR]
    launch suite EXAMPLES_DIR [--test-level N] [--junit FILE] [--summary FILE] [--exclude GLOB,...] [--runs-root DIR]
    launch report RUNS_ROOT [--out DIR] [--since DATE] [--example GLOB] [--rebuild-history]

Flags may stand before or after the overrides; each verb accepts its own flags only (any other
flag is an error naming the verb's flags).  Overrides use Hydra's syntax
(`stages.mmlu.lower_bound=0.62`, `executor=slurm`, `recipe=fp8_default`).
Exit codes (launcher.contract.ExitCode): 0 ok, 1 a stage failed, 2 invalid config or usage, 3 gate failed,
4 desync guard tripped, 5 preflight failed, 130 cancelled.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

from launcher.contract import ExitCode, JobState, StageStatus, UserError

EXIT_USAGE = ExitCode.USAGE
_HELP = ("--help", "-h")


@dataclass
class Args:
    positional: list[str] = field(default_factory=list)
    flags: dict[str, object] = field(default_factory=dict)

    def flag(self, name: str, default=None):
        return self.flags.get(name, default)


class _VerbParser(argparse.ArgumentParser):
    """argparse, with its usage errors raised as UserError (main prints them and exits 2)."""

    def error(self, message: str):
        raise UserError(message)


def verb_parser(verb: Optional[type] = None) -> argparse.ArgumentParser:
    """The verb's own parser (torchtune-style): its flags, with help; positionals are the CONFIG or
    directory and the Hydra overrides.  ``verb=None``: every verb's flags (parse_args' default)."""
    options = dict(o for v in (RunVerb, *VERBS.values()) if not getattr(v, "raw_argv", False) for o in v.OPTIONS) \
        if verb is None else dict(verb.OPTIONS)
    p = _VerbParser(prog=f"launch {verb.NAME}" if verb else "launch", usage=getattr(verb, "USAGE", None),
                    description=(verb.__doc__ or "").strip() if verb else None, add_help=False, allow_abbrev=False)
    p.add_argument(*_HELP, dest="--help", action="store_true", help="show this help")
    for flag, (metavar, text) in sorted(options.items()):
        if metavar:
            p.add_argument(flag, dest=flag, metavar=metavar, default=None, help=text)
        else:
            p.add_argument(flag, dest=flag, action="store_true", help=text)
    p.add_argument("positional", nargs="*", metavar="ARG", help="CONFIG (or directory), then Hydra overrides")
    return p


def parse_args(argv: list[str], verb: Optional[type] = None) -> Args:
    """Positionals (config, overrides) and flags in any order. `--dryrun` is refused by name.

    ``verb``: only its flags are accepted (default: every verb's); any other flag, a misplaced one
    included, is an error naming the verb's flags."""
    parser = verb_parser(verb)
    value_flags = {a.option_strings[0] for a in parser._actions if a.option_strings and a.nargs is None}
    valid = sorted(o for a in parser._actions for o in a.option_strings)
    for i, tok in enumerate(argv):
        key = tok.split("=", 1)[0]
        if tok.startswith("-") and not tok.startswith("--=") and ("=" not in tok or tok.startswith("--")):
            if key not in valid:
                raise UserError(_unknown_flag(key, verb, valid))
            if tok in value_flags and i + 1 >= len(argv):
                raise UserError(f"{tok} needs a value")
    ns = vars(parser.parse_intermixed_args(argv))
    flags = {k: v for k, v in ns.items() if k != "positional" and v not in (None, False)}
    return Args(positional=list(ns["positional"]), flags=flags)


def _unknown_flag(flag: str, verb: Optional[type], valid: list[str]) -> str:
    hint = " (did you mean --dry-run?)" if flag != "--dry-run" and flag.replace("-", "") == "dryrun" else ""
    where = f" for `launch {verb.NAME}`" if verb is not None else ""
    owners = [v.NAME for v in (RunVerb, *VERBS.values()) if v is not verb and flag in v.FLAGS]
    elsewhere = f" ({flag} is a flag of `launch {'`, `launch '.join(owners)}`)" if owners else ""
    return f"unknown flag {flag}{hint}{where}; valid flags: {', '.join(valid)}{elsewhere}"


def _compose(args: Args):
    from launcher.config.compose import compose_example

    if not args.positional:
        raise UserError("missing CONFIG: the path of an example YAML (e.g. examples/tiny/Qwen3-MoE-tiny/megatron_lm_ptq.yaml)")
    config, overrides = args.positional[0], args.positional[1:]
    if args.flag("--runs-root"):
        overrides = [*overrides, f"runs_root={args.flag('--runs-root')}"]
    return compose_example(config, overrides)


class RunVerb:
    """Default verb: compose, validate, then dry-run, preflight or run the pipeline."""

    NAME = "CONFIG (run)"
    USAGE = "launch CONFIG [overrides...] [--dry-run [--json]] [--preflight] [--resume RUN_DIR] [--detach]"
    OPTIONS = (
        ("--dry-run", (None, "print the resolved config and the plan (no torch, no processes)")),
        ("--json", (None, "with --dry-run: the plan as JSON")),
        ("--preflight", (None, "start every stage's ranks and check their process groups only")),
        ("--detach", (None, "executor=slurm: submit and return (follow with `launch status`)")),
        ("--no-check-paths", (None, "skip the checks of checkpoints and datasets on this machine")),
        ("--resume", ("RUN_DIR", "rerun in RUN_DIR the stages whose manifest does not match the config")),
        ("--run-id", ("ID", "the run directory's name (default: date-time-random)")),
        ("--runs-root", ("DIR", "where run directories go (as the override runs_root=DIR)")),
        ("--history", (None, "append the run's record to <runs_root>/history.jsonl (for `launch report`)")),
    )
    FLAGS = tuple(f for f, _ in OPTIONS)

    def __call__(self, args: Args) -> int:
        from launcher.config.validate import validate

        cfg = _compose(args)
        dry = bool(args.flag("--dry-run"))
        warnings = validate(cfg, check_paths=not dry and not args.flag("--no-check-paths"))
        for w in warnings:
            print(f"[launch] warning: {w}", file=sys.stderr)
        if dry:
            return self.dry_run(cfg, as_json=bool(args.flag("--json")))
        from launcher import profiling

        try:   # PTQ_PROFILE names stages: a typo is refused before any rank starts
            profiling.stages_to_profile()
        except ValueError as e:
            raise UserError(str(e)) from None
        from launcher.pipeline import OUT_OF_SPACE, run_pipeline
        from launcher.rundir import RunDirectory

        resume = args.flag("--resume")
        if resume:
            run = RunDirectory(resume)
            if not run.is_run_directory():
                raise UserError(f"--resume {resume}: not a run directory (no metadata.json)")
            run.write_config(cfg)
        else:
            try:
                run = RunDirectory.create(cfg, run_id=args.flag("--run-id"))
            except OSError as e:
                if e.errno not in OUT_OF_SPACE:
                    raise
                raise UserError(f"runs_root={cfg.runs_root}: the run directory could not be written, no space "
                                f"left on the device ({e})") from None
        print(f"[launch] run directory: {run.path}", flush=True)
        try:
            return run_pipeline(cfg, run, resume=bool(resume), preflight_only=bool(args.flag("--preflight")),
                                detach=bool(args.flag("--detach")))
        finally:   # a crash too leaves a record (status interrupted)
            if args.flag("--history") and not args.flag("--preflight"):
                from launcher.report.history import append_run_or_warn

                append_run_or_warn(cfg.runs_root, run.path, example=args.positional[0])

    def dry_run(self, cfg, as_json: bool) -> int:
        from omegaconf import OmegaConf

        from launcher.pipeline import build_plans, describe_plan, format_json
        from launcher.rundir import masked_config

        plan = describe_plan(cfg)
        if as_json:
            print(format_json(plan))
            return 0
        print(OmegaConf.to_yaml(masked_config(cfg)))
        print(f"# plan: job {cfg.job_name}, executor {cfg.executor.kind}, recipe {cfg.recipe.name}")
        from launcher.topology import ParallelDims

        run_dir = os.path.join(os.path.abspath(cfg.runs_root), cfg.job_name, "<run_id>")
        plans = {p.name: p for p in build_plans(cfg, run_dir)}
        for st in plan["stages"]:
            if not st["enabled"]:
                reason = st.get("disabled_reason", "")
                print(f"\n## {st['name']}: disabled" + (f" - {reason}" if reason else ""))
                continue
            if "tensor_parallel_size" in st:
                print(f"\n## {st['name']}: 1 rank; vLLM tensor_parallel_size {st['tensor_parallel_size']}")
                print("   command: " + " ".join(self._command(cfg, plans[st["name"]], run_dir)))
                continue
            dims = ParallelDims.from_stage(cfg, st["name"])
            print(f"\n## {st['name']}: world {dims.world_size} = tp {dims.tp} x cp {dims.cp} x dp {dims.dp} x pp {dims.pp}"
                  f"; experts: etp {dims.etp} x ep {dims.ep} x edp {dims.edp} x pp {dims.pp}")
            if "shard_mode" in st:
                print(f"   mmlu shard_mode {st['shard_mode']} (shards over {st['shard_group']})")
            for kind, groups in dims.groups.items():
                shown = groups if dims.world_size <= 16 else f"{len(groups)} groups of {len(groups[0])}"
                print(f"   {kind:<9} {shown}")
            print("   command: " + " ".join(self._command(cfg, plans[st["name"]], run_dir)))
        return 0

    @staticmethod
    def _command(cfg, plan, run_dir: str) -> list[str]:
        from launcher.pipeline import make_executor

        return make_executor(cfg, run_dir).describe(plan)


class ValidateVerb:
    """`launch validate CONFIG [overrides]`: compose and validate only (no torch, no processes)."""

    NAME = "validate"
    USAGE = "launch validate CONFIG [overrides...] [--no-check-paths]"
    OPTIONS = (
        ("--no-check-paths", (None, "skip the checks of checkpoints and datasets on this machine")),
        ("--runs-root", ("DIR", "as the override runs_root=DIR")),
    )
    FLAGS = tuple(f for f, _ in OPTIONS)

    def __call__(self, args: Args) -> int:
        from launcher.config.validate import validate

        cfg = _compose(args)
        for w in validate(cfg, check_paths=not args.flag("--no-check-paths")):
            print(f"warning: {w}", file=sys.stderr)
        print(f"ok: {args.positional[0]} ({cfg.job_name}) is valid")
        return 0


class StatusVerb:
    """`launch status RUN_DIR`: each stage's state (from Slurm when the run was submitted there)."""

    NAME = "status"
    USAGE = "launch status RUN_DIR"
    OPTIONS: tuple = ()
    FLAGS: tuple = ()

    def __call__(self, args: Args) -> int:
        from launcher.rundir import RunDirectory

        if not args.positional:
            raise UserError("usage: launch status RUN_DIR")
        run = RunDirectory(args.positional[0])
        if not run.is_run_directory():
            raise UserError(f"{args.positional[0]}: not a run directory (no metadata.json)")
        meta = run.metadata()
        slurm_states: dict = {}
        if meta.get("executor") == "slurm":
            from launcher.executors.slurm import SlurmExecutor

            slurm_states = SlurmExecutor.status(run.path)
        print(f"run {meta.get('run_id')} ({meta.get('job_name')}): {meta.get('status')}")
        worst = 0
        for name, st in meta["stages"].items():
            state = slurm_states.get(name, st.get("status"))
            extra = f" job {st['job_id']}" if st.get("job_id") else ""
            reason = f" - {st['reason']}" if st.get("reason") else ""
            print(f"  {name:<11} {state}{extra}{reason}")
            if str(state).lower() in (StageStatus.FAILED, StageStatus.CANCELLED, JobState.TIMEOUT.lower()):
                worst = ExitCode.FAILED
        return worst


class VerifyVerb:
    """`launch verify EXPORT_DIR [--recipe NAME] [--source HF_DIR] [--num-layers N] [--num-experts N]
    [--samples N] [--json]`: check an HF export (its own flags; see launcher.export.verify)."""

    raw_argv = True
    NAME = "verify"
    FLAGS = ("--recipe", "--source", "--num-layers", "--num-experts", "--samples", "--json")

    def __call__(self, argv: list[str]) -> int:
        from launcher.export.verify import verify_export_main

        return verify_export_main(argv)


class SuiteVerb:
    """`launch suite EXAMPLES_DIR [--test-level N] [--junit FILE] [--summary FILE] [--exclude GLOB,...]`:
    the nightly suite."""

    NAME = "suite"
    USAGE = "launch suite EXAMPLES_DIR [overrides...] [--test-level N] [--junit FILE] [--summary FILE] [--exclude GLOB,...]"
    OPTIONS = (
        ("--test-level", ("N", "run examples whose test_level <= N (default 0)")),
        ("--junit", ("FILE", "write JUnit XML (and a Markdown summary beside it)")),
        ("--summary", ("FILE", "write the Markdown summary here")),
        ("--exclude", ("GLOB,...", "report examples matching these globs as skipped")),
        ("--runs-root", ("DIR", "where the examples' runs go (as the override runs_root=DIR)")),
    )
    FLAGS = tuple(f for f, _ in OPTIONS)

    def __call__(self, args: Args) -> int:
        from launcher.suite import run_suite

        if not args.positional:
            raise UserError("usage: launch suite EXAMPLES_DIR [--test-level N] [--junit FILE]")
        level = str(args.flag("--test-level", 0))
        if not level.isdigit():
            raise UserError(f"--test-level {level}: valid: an integer >= 0")
        return run_suite(args.positional[0], test_level=int(level),
                         junit=args.flag("--junit"), summary=args.flag("--summary"),
                         overrides=args.positional[1:], runs_root=args.flag("--runs-root"),
                         exclude=[p for p in str(args.flag("--exclude") or "").split(",") if p])


class ReportVerb:
    """`launch report RUNS_ROOT [--out DIR] [--since DATE] [--example GLOB]`: the runs' history as a
    static page (index.html + images; no server, no JavaScript)."""

    NAME = "report"
    USAGE = "launch report RUNS_ROOT [--out DIR] [--since DATE] [--example GLOB,...] [--rebuild-history]"
    OPTIONS = (
        ("--out", ("DIR", "where index.html and img/ go (default RUNS_ROOT/report)")),
        ("--since", ("DATE", "runs started on or after DATE (2026-11-01, 2026-11-01T20:00, or 30d)")),
        ("--example", ("GLOB,...", "only examples whose job name (or example path) matches")),
        ("--rebuild-history", (None, "rewrite RUNS_ROOT/history.jsonl from the run directories first")),
    )
    FLAGS = tuple(f for f, _ in OPTIONS)

    def __call__(self, args: Args) -> int:
        from launcher.report.build import report_main

        if len(args.positional) != 1:
            raise UserError("usage: " + self.USAGE)
        return report_main(args.positional[0], out=args.flag("--out"), since=args.flag("--since"),
                           example=args.flag("--example"), rebuild=bool(args.flag("--rebuild-history")))


VERBS = {"validate": ValidateVerb, "status": StatusVerb, "verify": VerifyVerb, "suite": SuiteVerb,
         "report": ReportVerb}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        verb_cls = VERBS.get(argv[0]) if argv else None
        if verb_cls is not None and not os.path.exists(argv[0]):
            argv = argv[1:]
        else:
            verb_cls = RunVerb
        if getattr(verb_cls, "raw_argv", False):
            return verb_cls()(argv)
        args = parse_args(argv, verb_cls)
        if args.flag("--help") or not argv:
            print(__doc__ if verb_cls is RunVerb else verb_parser(verb_cls).format_help())
            if verb_cls is RunVerb and argv:
                print(verb_parser(RunVerb).format_help())
            return 0 if argv else EXIT_USAGE
        return verb_cls()(args)
    except UserError as e:   # the user's input (ConfigError, a data file, a path): its lines, no traceback
        print(f"launch: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
