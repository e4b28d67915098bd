"""One JSON report of a `scripts/gpu_checks.sh` call: commit, versions, and per part its exit
code, seconds and figures (pytest counts; per pipeline run: stage times and statuses, the gate's
accuracy, the export's flips against the gated weights, size, the patches each stage applied).

    python3 scripts/gpu_report.py REPORT_DIR [PART=RUN_ROOT ...]

Reads REPORT_DIR/parts.txt (written by gpu_checks.sh), the part logs and, for each PART=RUN_ROOT,
the newest run directory under RUN_ROOT; writes REPORT_DIR/report.json and prints a summary.
Commit: $PTQ_COMMIT, else .gpu-cache/commit.txt (scripts/prepare_gpu_payload.sh writes it; the
device machine gets no .git).
"""
from __future__ import annotations

import glob
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PART_LINE = re.compile(r"^== (\S+): exit (\d+) in (\d+) s$")
GROUP_LINE = re.compile(r"^== group (\S+): (\d+) s$")   # parts run side by side (PART+PART): the group's wall
PYTEST_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|error|errors|deselected)")


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _commit() -> str:
    if os.environ.get("PTQ_COMMIT"):
        return os.environ["PTQ_COMMIT"]
    try:
        with open(os.path.join(ROOT, ".gpu-cache", "commit.txt")) as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _versions(out_dir: str) -> dict:
    """The device's versions: parts.txt's lines (gpu_checks.sh writes them there), else this
    interpreter's (when the report is built where the checks ran)."""
    try:
        with open(os.path.join(out_dir, "parts.txt")) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    if len(lines) >= 2 and lines[1].startswith("torch "):
        words = lines[1].split()
        out = {"gpu": lines[0], **dict(zip(words[::2], words[1::2]))}
        for line in lines[2:]:
            if line.startswith("versions "):
                out.update(kv.split("=", 1) for kv in line.split()[1:])
        return out
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "triton", "megatron-core", "nvidia-modelopt", "transformers", "mamba_ssm", "vllm",
                 "transformer_engine"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    try:
        out["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                     "--format=csv,noheader"], capture_output=True, text=True,
                                    timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out["gpu"] = None
    return out


def pytest_counts(log_path: str) -> dict | None:
    try:
        with open(log_path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if " in " in line and ("passed" in line or "failed" in line or "error" in line):
            return {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
                    for n, kind in PYTEST_COUNTS.findall(line)}
    return None


def run_figures(run_dir: str) -> dict:
    """What one pipeline run directory says: stages, gate, export verification, patches."""
    meta = _read_json(os.path.join(run_dir, "metadata.json")) or {}
    out = {"run_dir": run_dir, "status": meta.get("status"),
           "stages": {s: {k: v for k, v in d.items() if k in ("status", "duration_s", "exit_code", "error")}
                      for s, d in (meta.get("stages") or {}).items()}}
    for stage in ("quantize", "mmlu", "export"):
        manifest = _read_json(os.path.join(run_dir, stage, "manifest.json"))
        if manifest:
            out["stages"].setdefault(stage, {})["patches"] = manifest.get("patches")
    res = _read_json(os.path.join(run_dir, "mmlu", "results.json"))
    if res:
        out["gate"] = {k: res.get(k) for k in ("accuracy", "n", "correct", "interval", "lower_bound", "pass",
                                               "agreement")}
        out["gate"]["timings"] = res.get("timings")
    ver = _read_json(os.path.join(run_dir, "export", "verify.json"))
    if ver:
        ref = (ver.get("checks") or {}).get("dequant_vs_megatron") or {}
        kinds = ref.get("by_kind") or {}
        out["export"] = {"ok": ver.get("ok"), "format": ver.get("format"), "errors": ver.get("errors"),
                         "flips": sum(k.get("flips", 0) for k in kinds.values()),
                         "elements_compared": sum(k.get("elements", 0) for k in kinds.values()),
                         "modules_compared": sum(k.get("modules", 0) for k in kinds.values()),
                         "bit_exact_modules": sum(k.get("bit_exact", 0) for k in kinds.values()),
                         "by_kind": kinds, "tolerance": ref.get("tolerance"), "size": ver.get("size"),
                         "verify_seconds": ver.get("seconds")}
    return out


def vllm_table(out_dir: str) -> list[dict]:
    """One row per REPORT_DIR/vllm-CASE-MODE.json (gpu_checks.sh's `vllm` part): the smoke's verdict,
    agreement, served vs gate accuracy, load and score times, and the kernels vLLM chose."""
    rows = []
    for path in sorted(glob.glob(os.path.join(out_dir, "vllm-*-*.json"))):
        case, mode = os.path.basename(path)[len("vllm-"):-len(".json")].rsplit("-", 1)
        rec = _read_json(path) or {}
        if mode == "skip":
            rows.append({"case": case, "mode": "skip", "passed": False, "reason": rec.get("reason")})
            continue
        ch, t, k = rec.get("choices") or {}, rec.get("timings") or {}, rec.get("kernels") or {}
        rows.append({"case": case, "mode": mode, "passed": rec.get("passed"), "failure": rec.get("failure"),
                     "agreement": rec.get("agreement"), "min_agreement": (rec.get("criteria") or {}).get("min_agreement"),
                     "nvfp4_kernels": (rec.get("criteria") or {}).get("nvfp4_kernels", "auto"),
                     "n_agree": ch.get("n_agree"), "n_counted": ch.get("n_counted"), "n": ch.get("n"),
                     "accuracy": rec.get("accuracy"), "gate_accuracy": ch.get("gate_accuracy"),
                     "generation": {k2: (rec.get("generation") or {}).get(k2) for k2 in ("n_passed", "n_scored")},
                     "startup_s": t.get("startup_s"), "score_s": t.get("score_s"), "total_s": t.get("total_s"),
                     "kernel_family": k.get("family"), "kernels": k.get("choices")})
    return rows


def newest_run(root: str) -> str | None:
    runs = sorted(glob.glob(os.path.join(root, "*", "*", "metadata.json")), key=os.path.getmtime)
    return os.path.dirname(runs[-1]) if runs else None


def build_report(out_dir: str, run_roots: dict[str, str]) -> dict:
    parts, groups = {}, {}
    try:
        with open(os.path.join(out_dir, "parts.txt")) as f:
            for line in f:
                m = PART_LINE.match(line.strip())
                if m:
                    parts[m.group(1)] = {"exit": int(m.group(2)), "seconds": int(m.group(3)),
                                         "pass": m.group(2) == "0"}
                g = GROUP_LINE.match(line.strip())
                if g:
                    groups[g.group(1)] = int(g.group(2))
    except OSError:
        pass
    for name, info in parts.items():
        for log in (f"{name}.log", f"{name}_tests.log", "tests.log" if name == "tests" else ""):
            counts = pytest_counts(os.path.join(out_dir, log)) if log else None
            if counts:
                info["pytest"] = counts
                break
        if name in run_roots:
            run = newest_run(run_roots[name])
            info["run"] = run_figures(run) if run else None
    extra = {os.path.basename(p): _read_json(p) for p in sorted(glob.glob(os.path.join(out_dir, "*.json")))
             if os.path.basename(p) != "report.json"}
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "commit": _commit(),
            "versions": _versions(out_dir), "parts": parts, "side_by_side_s": groups, "all_pass": bool(parts) and all(p["pass"] for p in parts.values()),
            "vllm": vllm_table(out_dir), "artifacts": extra}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir, roots = argv[0], dict(a.split("=", 1) for a in argv[1:])
    report = build_report(out_dir, roots)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    for name, p in report["parts"].items():
        run = p.get("run") or {}
        exp, gate = run.get("export") or {}, run.get("gate") or {}
        bits = [f"exit {p['exit']}", f"{p['seconds']} s"]
        if p.get("pytest"):
            bits.append(" ".join(f"{v} {k}" for k, v in p["pytest"].items()))
        if gate:
            bits.append(f"gate {gate.get('correct')}/{gate.get('n')}")
        if exp:
            bits.append(f"export ok={exp.get('ok')} flips={exp.get('flips')}/{exp.get('elements_compared')}")
        print(f"[report] {name}: " + ", ".join(bits))
    for r in report["vllm"]:
        print(f"[report] vllm {r['case']} {r['mode']}: passed={r['passed']} agreement={r.get('agreement')} "
              f"accuracy={r.get('accuracy')} vs gate {r.get('gate_accuracy')} kernels={r.get('kernel_family')} "
              f"{r.get('reason') or r.get('failure') or ''}")
    for group, seconds in report["side_by_side_s"].items():
        print(f"[report] side by side {group}: {seconds} s")
    print(f"[report] commit {report['commit']}, all pass: {report['all_pass']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
