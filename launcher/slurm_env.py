"""What a rank learns from Slurm's environment under ``srun`` (pure functions, no torch, no I/O).

srun gives every task SLURM_PROCID (global rank), SLURM_NTASKS, SLURM_LOCALID (rank on its node),
SLURM_NODEID (this node's index in the step), SLURM_STEP_NODELIST / SLURM_JOB_NODELIST (the nodes,
in Slurm's compressed hostlist form: ``node[01-02]``, ``a[1-3,10],b7``, ``r[1-2]n[1-2]``) and
SLURM_STEP_TASKS_PER_NODE (``2(x2)`` or ``3,2``).  The rendezvous of torch.distributed needs
MASTER_ADDR and MASTER_PORT: the sbatch script exports both (slurm_script.py: the first host of
the node list, the port from the job id); ``rendezvous_defaults`` derives the same two values
from the same variables, so ranks started by a plain ``srun`` inside someone else's allocation
meet at the same place.
"""
from __future__ import annotations

import re
from typing import Mapping, Optional

# MASTER_PORT when executor.master_port is 0: jobs sharing a node never collide
DERIVED_PORT_BASE = 20000
DERIVED_PORT_SPAN = 20000
_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def derived_port(job_id: int) -> int:
    """The MASTER_PORT the sbatch script computes as ``BASE + SLURM_JOB_ID % SPAN``."""
    return DERIVED_PORT_BASE + int(job_id) % DERIVED_PORT_SPAN


def _split_top(spec: str) -> list[str]:
    """Split on the commas that are outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in spec:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"invalid hostlist {spec!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"invalid hostlist {spec!r}: ']' without '['")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"invalid hostlist {spec!r}: '[' without ']'")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_ranges(body: str, spec: str) -> list[str]:
    out = []
    for item in body.split(","):
        m = _RANGE.match(item)
        if not m:
            raise ValueError(f"invalid hostlist {spec!r}: bad range {item!r}")
        lo_s, hi_s = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise ValueError(f"invalid hostlist {spec!r}: range {item!r} runs backwards")
        width = len(lo_s)          # Slurm pads to the lower bound's width: n[08-10] -> n08 n09 n10
        out += [str(i).zfill(width) for i in range(lo, hi + 1)]
    return out


def expand_hostlist(spec: str) -> list[str]:
    """Slurm's compressed host list -> host names in order, like ``scontrol show hostnames``."""
    hosts: list[str] = []
    for entry in _split_top(spec or ""):
        names = [""]
        for literal, body in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", entry):
            if not literal and body == "":
                continue
            names = [n + literal for n in names]
            if body:
                names = [n + r for n in names for r in _expand_ranges(body, spec)]
        hosts += names
    return hosts


def tasks_on_node(tasks_per_node: str, node_id: int) -> Optional[int]:
    """This node's task count from SLURM_STEP_TASKS_PER_NODE (``2(x2)``, ``3,2``, ``2(x3),1``)."""
    counts: list[int] = []
    for part in (tasks_per_node or "").split(","):
        m = _TASKS.match(part.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node_id] if 0 <= node_id < len(counts) else None


def under_srun(environ: Mapping[str, str]) -> bool:
    """True when srun started this process (and no launcher set RANK itself)."""
    return bool(environ.get("SLURM_PROCID")) and bool(environ.get("SLURM_JOB_ID")) and not environ.get("RANK")


def rendezvous_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """MASTER_ADDR / MASTER_PORT that srun's variables imply (the first host of the step's nodes,
    the port derived from the job id); {} when not under srun.  Values already set win (callers
    use setdefault): the sbatch script exports the same two."""
    if not under_srun(environ):
        return {}
    nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
    hosts = expand_hostlist(nodes)
    out = {"MASTER_PORT": str(derived_port(int(environ["SLURM_JOB_ID"])))}
    if hosts:
        out["MASTER_ADDR"] = hosts[0]
    return out
