""".ci/durations_per_file.py: the per-file totals .ci/run prints after pytest's 25 slowest tests."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, ".ci", "durations_per_file.py")

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.test_a" name="t1" time="1.5" />
<testcase classname="tests.test_a.TestGroup" name="t2" time="2.0"><failure message="x"/></testcase>
<testcase classname="tests.test_b" name="t3" time="10.25"><skipped message="no slurm"/></testcase>
<testcase classname="tests.test_b" name="t4" time="0.25" />
<testcase classname="tests.test_c" name="t5" time="0" file="tests/test_c.py"><error message="e"/></testcase>
</testsuite></testsuites>"""


def test_totals_per_file_slowest_first(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(REPORT)
    out = subprocess.run([sys.executable, SCRIPT, str(report)], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0] == "[ci] total per file (3 files, 5 tests, 14.0 s of test time):"
    assert [line.split()[-1] for line in lines[1:]] == ["tests/test_b.py", "tests/test_a.py", "tests/test_c.py"]
    assert lines[1].split()[1:6] == ["10.5", "s", "75.0%", "2", "tests,"] and "1 skipped" in lines[1]
    assert lines[2].split()[1] == "3.5" and "1 failed" in lines[2]
    assert "1 failed" in lines[3]


def test_a_missing_report_says_so(tmp_path):
    p = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "none.xml")], capture_output=True, text=True)
    assert p.returncode == 1 and "[ci] no per-file durations" in p.stderr


def test_ci_run_keeps_the_readme_test_command():
    text = open(os.path.join(ROOT, ".ci", "run")).read()
    assert 'make test PYTEST_ARGS="-p no:cacheprovider --durations=25 --junitxml=$junit"' in text
    assert 'python3 .ci/durations_per_file.py "$junit"' in text
