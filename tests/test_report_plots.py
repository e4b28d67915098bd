"""The plots show what the history holds: for a synthetic history with known counts, the figure
each plotting function returns has the right points, the right 95% bands, the bounds, the
failed gate marked, a gap (not a zero) where a run has no gate, and stacked stage times."""
import math
import struct
import subprocess
import sys

import numpy as np
import pytest

from launcher.mmlu.gate import wilson_interval
from launcher.mmlu.paired import clopper_pearson
from launcher.report import plots
from launcher.report.history import collect
from report_runs import ROOT, make_run

# (baseline_correct, n10, n01, lower_bound, max_drop) of n=320 questions, oldest first
NIGHTS = [(310, 2, 1, 0.85, 0.05), (310, 9, 1, 0.85, 0.05), (310, 20, 2, 0.90, 0.05), (310, 4, 0, 0.99, 0.03)]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("runs"))
    for i, (b, n10, n01, bound, md) in enumerate(NIGHTS):
        make_run(root, f"2026110{i + 1}-010000-aaaa", f"2026-11-0{i + 1}T01:00:00", baseline_correct=b, n10=n10,
                 n01=n01, lower_bound=bound, max_drop=md, seconds=(60.0 + i, 40.0, 30.0, 5.0),
                 size_ratio=0.36 + 0.01 * i)
    make_run(root, "20261105-010000-aaaa", "2026-11-05T01:00:00", interrupted_in="mmlu")
    recs, _ = collect(root)
    return recs


def _line(ax, label):
    found = [ln for ln in ax.get_lines() if ln.get_label() == label]
    assert len(found) == 1, [ln.get_label() for ln in ax.get_lines()]
    return found[0]


def _band(ax, label):
    """{x: (lo, hi)} of a fill_between band, read from its polygon's vertices."""
    found = [c for c in ax.collections if c.get_label() == label]
    assert len(found) == 1
    out = {}
    for path in found[0].get_paths():
        for x, y in path.vertices:
            lo, hi = out.get(round(x, 6), (math.inf, -math.inf))
            out[round(x, 6)] = (min(lo, y), max(hi, y))
    return out


def _accuracies():
    return [(b - n10 + n01) / 320 for b, n10, n01, _, _ in NIGHTS]


def test_accuracy_plot_has_points_band_bound_baseline_and_failed_gate(records, tmp_path):
    p = plots.plot_accuracy(records, str(tmp_path), "ex")
    ax = p.axes
    y = _line(ax, "accuracy").get_ydata()
    assert np.allclose(y[:4], _accuracies()) and math.isnan(y[4])     # the interrupted run: a gap
    band = _band(ax, "95% interval")
    for i, (b, n10, n01, _, _) in enumerate(NIGHTS):
        assert band[i] == pytest.approx(wilson_interval(b - n10 + n01, 320))
    assert 4 not in band
    assert list(_line(ax, "lower_bound").get_ydata()[:4]) == [0.85, 0.85, 0.90, 0.99]
    assert np.allclose(_line(ax, "baseline").get_ydata()[:4], 310 / 320)
    failed = _line(ax, "gate failed")        # night 3 (drop 18/320 > 0.05) and night 4 (306/320 < 0.99)
    assert list(failed.get_xdata()) == [2, 3] and np.allclose(failed.get_ydata(), [292 / 320, 306 / 320])
    assert p.x_labels == ["11-01 01:00", "11-02 01:00", "11-03 01:00", "11-04 01:00", "11-05 01:00"]
    with open(p.path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24]) == (640, 300)


def test_drop_plot_has_the_known_drops_their_mcnemar_bands_and_max_drop(records, tmp_path):
    ax = plots.plot_drop(records, str(tmp_path), "ex").axes
    drops = [(n10 - n01) / 320 for _, n10, n01, _, _ in NIGHTS]
    assert np.allclose(_line(ax, "paired drop").get_ydata()[:4], drops)
    band = _band(ax, "95% interval")
    for i, (_, n10, n01, _, _) in enumerate(NIGHTS):
        m = n10 + n01
        lo, hi = clopper_pearson(n10, m)
        assert band[i] == pytest.approx(((2 * lo - 1) * m / 320, (2 * hi - 1) * m / 320))
    assert band[2][0] > 0 and drops[2] > 0.05 > drops[1]   # night 3: a real drop (interval above 0), over max_drop
    assert list(_line(ax, "max_drop").get_ydata()[:4]) == [0.05, 0.05, 0.05, 0.03]


def test_kl_stage_times_and_size_ratio(records, tmp_path):
    kl = _line(plots.plot_kl(records, str(tmp_path), "ex").axes, "mean KL").get_ydata()
    assert kl[0] > 0 and kl[2] > kl[1] > kl[0] and math.isnan(kl[4])    # more flips, more KL
    ax = plots.plot_stage_times(records, str(tmp_path), "ex").axes
    bars = {c.get_label(): [r.get_height() for r in c] for c in ax.containers}
    assert bars["quantize"] == [60.0, 61.0, 62.0, 63.0, 60.0]            # the interrupted run's quantize
    assert bars["mmlu"] == [40.0, 40.0, 40.0, 40.0, 0.0]
    assert bars["export"] == [30.0, 30.0, 0.0, 0.0, 0.0]                  # nights 3, 4: the gate failed
    bottoms = [r.get_y() for r in ax.containers[1]]
    assert bottoms == bars["quantize"]                                    # stacked
    ratio = _line(plots.plot_size_ratio(records, str(tmp_path), "ex").axes, "export / bf16").get_ydata()
    assert np.allclose(ratio[:2], [0.36, 0.37]) and all(math.isnan(v) for v in ratio[2:])


def test_a_history_without_gates_still_gives_every_image(tmp_path):
    make_run(str(tmp_path), "r1", "2026-11-01T01:00:00", interrupted_in="quantize")
    recs, _ = collect(str(tmp_path))
    out = plots.plot_example(recs, str(tmp_path / "img"), "ex")
    assert [p.kind for p in out] == ["accuracy", "drop", "kl", "stage_times", "size_ratio"]
    assert out[0].empty == "no gate results in these runs" and all((tmp_path / "img" / f"ex-{p.kind}.png").is_file()
                                                                    for p in out)


def test_launch_report_imports_no_torch(records, tmp_path):
    root = records[0]["run_dir"].rsplit("/", 2)[0]
    code = ("import sys; from launcher.cli import main; rc = main(['report', %r, '--out', %r]); "
            "assert rc == 0, rc; assert 'torch' not in sys.modules, 'torch imported'" % (root, str(tmp_path / "out")))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "5 run(s) of 1 example(s), 3 failure(s)" in proc.stdout
