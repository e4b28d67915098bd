"""launcher_testing.locked_build: the tiny models' and SmolLM2's build-once-and-publish helper."""
from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest

from launcher_testing.locked_build import locked_build, read_build_info


def _write(tmp: Path, text: str = "new") -> None:
    (tmp / "build.json").write_text(f'{{"v": "{text}"}}')


def test_builds_publishes_and_reuses(tmp_path):
    target = tmp_path / "m"
    built = []
    current = lambda: read_build_info(target) == {"v": "new"}   # noqa: E731
    assert locked_build(target, current, lambda tmp: built.append(_write(tmp))) == target
    assert read_build_info(target) == {"v": "new"} and len(built) == 1
    assert target.stat().st_mode & 0o777 == 0o755
    locked_build(target, current, lambda tmp: built.append(_write(tmp)))
    assert len(built) == 1                                   # current: not rebuilt
    locked_build(target, current, lambda tmp: built.append(_write(tmp, "forced")), force=True)
    assert len(built) == 2 and read_build_info(target) == {"v": "forced"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]


def test_a_failed_build_leaves_the_old_target_and_no_leftovers(tmp_path):
    target = tmp_path / "m"
    locked_build(target, lambda: False, _write)
    (tmp_path / ".m.tmp-killed").mkdir()                    # a killed builder's leftovers
    (tmp_path / ".m.old-killed").mkdir()

    def broken(tmp: Path) -> None:
        _write(tmp, "half")
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError, match="build failed"):
        locked_build(target, lambda: False, broken)
    assert read_build_info(target) == {"v": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]


def test_a_file_in_the_way_is_a_value_error(tmp_path):
    (tmp_path / "m").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        locked_build(tmp_path / "m", lambda: False, _write)


def _slow_builder(target: str, builds: str) -> None:
    def build(tmp: Path) -> None:
        time.sleep(0.5)
        _write(tmp)
        with open(builds, "a") as f:
            f.write("built\n")

    locked_build(Path(target), lambda: read_build_info(target) is not None, build)


def test_concurrent_callers_build_once(tmp_path):
    builds = tmp_path / "builds.txt"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_slow_builder, args=(str(tmp_path / "m"), str(builds))) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert builds.read_text() == "built\n" and read_build_info(tmp_path / "m") == {"v": "new"}
