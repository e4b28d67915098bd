"""benchmarks/suite_cpu.py: a serial run's tests placed on the clock from the JUnit file, the machine's
busy share from vmstat over each, per file, and the bound that sets on any overlap."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("suite_cpu", ROOT / "benchmarks" / "suite_cpu.py")
suite_cpu = importlib.util.module_from_spec(spec)
sys.modules["suite_cpu"] = suite_cpu      # its dataclass looks its module up there
spec.loader.exec_module(suite_cpu)

VMSTAT_HEAD = ("procs -----------memory---------- ---swap-- -----io---- -system-- ------cpu----- -----timestamp-----\n"
               " r  b   swpd   free   buff  cache   si   so    bi    bo   in   cs us sy id wa st                 UTC\n")


def vmstat_line(us: int, sy: int, hms: str) -> str:
    idle = 100 - us - sy
    return f" 2  0      0 22057736 140076 2287200    0    0  0  0  444  178 {us} {sy} {idle}  0  0 2026-12-07 {hms}\n"


@pytest.fixture
def run(tmp_path):
    """Three tests from 10:00:00: test_a.py 10 s, test_b.py 5 s, test_a.py 5 s (a test class's: named by
    .ci/durations_per_file.py's file_of, as .ci/run's totals are); vmstat every 10 s from 09:59:50 (the
    first line, averages since boot, says 99% and must not count): 10:00:00-10:00:10 half the cores
    busy (40 + 10), 10:00:10-10:00:20 all of them (90 + 10)."""
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" timestamp='
        '"2026-12-07T10:00:00+00:00" time="20"><testcase classname="tests.test_a" name="t1" time="10"/>'
        '<testcase classname="tests.test_b" name="t2" time="5"/>'
        '<testcase classname="tests.test_a.TestThree" name="t3" time="5"/>'
        '</testsuite></testsuites>')
    vmstat = tmp_path / "vmstat.log"
    vmstat.write_text(VMSTAT_HEAD + vmstat_line(90, 9, "09:59:50") + vmstat_line(40, 10, "10:00:00")
                      + vmstat_line(40, 10, "10:00:10") + vmstat_line(90, 10, "10:00:20"))
    return junit, vmstat


def test_each_file_gets_the_busy_core_seconds_of_its_own_tests(run):
    junit, vmstat = run
    start, tests = suite_cpu.read_junit(str(junit))
    samples = suite_cpu.read_vmstat(str(vmstat))
    assert [s.busy for s in samples] == [0.5, 0.5, 1.0] and all(s.seconds == 10 for s in samples)
    assert tests == [("tests/test_a.py", 10.0), ("tests/test_b.py", 5.0), ("tests/test_a.py", 5.0)]
    files = suite_cpu.per_file(start, tests, samples, cores=2)
    # test_a.py: 10 s at half of 2 cores (10 core-s) + 5 s at both (10 core-s); test_b.py: 5 s at both (10 core-s)
    assert files["tests/test_a.py"] == {"wall_s": 15.0, "busy_core_s": 20.0, "utilisation": 20 / 30}
    assert files["tests/test_b.py"] == {"wall_s": 5.0, "busy_core_s": 10.0, "utilisation": 1.0}
    s = suite_cpu.summary(files, cores=2, target_s=12.0)
    assert s == {"wall_s": 20.0, "busy_core_s": 30.0, "cores": 2, "utilisation": 0.75, "lower_bound_s": 15.0,
                 "target_s": 12.0, "target_reachable_by_overlap_alone": False, "cpu_work_to_cut_for_target": 0.2}
    assert suite_cpu.summary(files, cores=2, target_s=15.0)["target_reachable_by_overlap_alone"] is True


def test_the_command_writes_the_figures_and_prints_the_bound(run, tmp_path, capsys):
    junit, vmstat = run
    out = tmp_path / "out.json"
    assert suite_cpu.main(["--junit", str(junit), "--vmstat", str(vmstat), "--cores", "2", "--target-s", "12",
                           "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert ("suite: 20 s wall, 30 core-seconds busy on 2 cores (utilisation 0.75); the shortest any overlap could "
            "make it: 15 s (target 12 s: 20% of the CPU work must go)") in printed
    doc = json.loads(out.read_text())
    assert list(doc["files"]) == ["tests/test_a.py", "tests/test_b.py"] and doc["summary"]["lower_bound_s"] == 15.0


def test_inputs_that_are_not_what_they_should_be_are_refused(tmp_path, run):
    junit, _ = run
    empty = tmp_path / "empty.log"
    empty.write_text(VMSTAT_HEAD + vmstat_line(90, 9, "09:59:50"))
    with pytest.raises(ValueError, match=r"--vmstat .*empty.log: no samples \(expected `vmstat -t N` output"):
        suite_cpu.read_vmstat(str(empty))
    bare = tmp_path / "bare.xml"
    bare.write_text('<testsuites><testsuite name="pytest"></testsuite></testsuites>')
    with pytest.raises(ValueError, match=r"--junit .*bare.xml: no <testsuite timestamp=...>"):
        suite_cpu.read_junit(str(bare))
    with pytest.raises(SystemExit):
        suite_cpu.main(["--junit", str(junit), "--vmstat", str(empty), "--cores", "0"])


def test_a_run_with_workers_is_measured_whole_over_the_suites_own_wall(run, tmp_path, capsys):
    """Two workers: the tests' times add up to 20 s in a suite of 10 s, so they are not laid end to end;
    the suite's 10 s (10:00:00-10:00:10, half the cores busy) give 10 core-seconds, and no file rows."""
    _, vmstat = run
    junit = tmp_path / "workers.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest" timestamp="2026-12-07T10:00:00+00:00" time="10">'
        '<testcase classname="tests.test_a" name="t1" time="10"/><testcase classname="tests.test_b" name="t2" '
        'time="10"/></testsuite></testsuites>')
    out = tmp_path / "out.json"
    assert suite_cpu.main(["--junit", str(junit), "--vmstat", str(vmstat), "--cores", "2", "--target-s", "4",
                           "--workers", "2", "--out", str(out)]) == 0
    assert ("suite: 10 s wall, 10 core-seconds busy on 2 cores (utilisation 0.50); the shortest any overlap "
            "could make it: 5 s (target 4 s: 20% of the CPU work must go)") in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["workers"] == 2 and doc["files"] == {} and doc["summary"]["busy_core_s"] == 10.0
    with pytest.raises(SystemExit):
        suite_cpu.main(["--junit", str(junit), "--vmstat", str(vmstat), "--workers", "-1"])
    bare = tmp_path / "no-time.xml"
    bare.write_text('<testsuites><testsuite name="pytest" timestamp="2026-12-07T10:00:00+00:00"/></testsuites>')
    with pytest.raises(ValueError, match=r"--junit .*no-time.xml: no <testsuite time=...>"):
        suite_cpu.read_suite_wall(str(bare))
