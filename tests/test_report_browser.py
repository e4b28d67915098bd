"""`launch report`'s page in a real browser: headless Chromium (Debian's `chromium`, installed by
scripts/install_chromium.sh, a prerequisite of `make test`) loads it from disk.  Its DOM
(--dump-dom) shows the failures first - the newest first - every example's row in the latest-runs
table, and every plot's <img> loaded (naturalWidth > 0).  A screenshot is kept as a test artifact
under $PTQ_TEST_ARTIFACTS (default test-artifacts/)/report-browser/.

naturalWidth is not an attribute, so the test - not the page, which has no script - renders a
copy of index.html with a small script that copies each image's naturalWidth into
data-natural-width after the window's load event."""
import os
import shutil
import subprocess
import tempfile
import time
from html.parser import HTMLParser

import pytest

from launcher.report.build import build_report
from launcher.report.history import append_run
from report_runs import ROOT, make_run

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# without the background-networking flags Chromium's own connections are refused on a closed network
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]
ARTIFACTS = os.path.join(os.environ.get("PTQ_TEST_ARTIFACTS", os.path.join(ROOT, "test-artifacts")), "report-browser")
PROBE = """<script>
window.addEventListener("load", function () {
  document.querySelectorAll("img").forEach(function (img) {
    img.setAttribute("data-natural-width", String(img.naturalWidth));
  });
  document.body.setAttribute("data-probe", "done");
});
</script>
"""


def chromium(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: run `bash scripts/install_chromium.sh` (a prerequisite of make test)")
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        return subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout)


class Dom(HTMLParser):
    """Every start tag, in document order: (tag, attributes)."""

    def __init__(self, html: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def find(self, tag=None, **attrs) -> list[tuple[int, dict]]:
        return [(i, a) for i, (t, a) in enumerate(self.tags)
                if (tag is None or t == tag) and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A runs root with two examples: NVFP4 (3 nights: pass, failed gate, interrupted) and FP8
    (2 nights, both pass), plus a history line of a run whose directory is gone."""
    root = str(tmp_path_factory.mktemp("runs"))
    make_run(root, "20261101-010000-aaaa", "2026-11-01T01:00:00")
    make_run(root, "20261102-010000-aaaa", "2026-11-02T01:00:00", lower_bound=0.99)
    make_run(root, "20261103-010000-aaaa", "2026-11-03T01:00:00", interrupted_in="export")
    gone = make_run(root, "20261031-010000-aaaa", "2026-10-31T01:00:00")
    append_run(root, gone)
    shutil.rmtree(gone)
    for day in (1, 2):
        make_run(root, f"2026110{day}-020000-aaaa", f"2026-11-0{day}T02:00:00", job_name="tiny-qwen3-moe-fp8",
                 recipe="fp8_default", size_ratio=0.55, vllm="served")
    index, shown, _ = build_report(root, rebuild=True)
    return root, index


def test_page_in_headless_chromium(report):
    root, index = report
    html = open(index).read()
    assert "<script" not in html                                  # readable without JavaScript
    probe = os.path.join(os.path.dirname(index), "index-probe.html")
    with open(probe, "w") as f:
        # a control image that cannot load: the probe must see 0 for it
        f.write(html.replace("</body>", '<img src="img/no-such.png" alt="control" data-plot="control">'
                             + PROBE + "</body>"))
    t0 = time.time()
    proc = chromium("--virtual-time-budget=15000", "--dump-dom", "file://" + probe)
    dump_s = time.time() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    dom = Dom(proc.stdout)
    assert dom.find("body", data_probe="done"), "the probe did not run: the page never finished loading"

    # failures first: the failures section is the first section, its newest failure first
    sections = [a.get("id") for _, a in dom.find("section")]
    assert sections[:2] == ["failures", "latest"], sections
    failures = [a for _, a in dom.find("div") if "failure" in (a.get("class") or "").split()]
    assert [f["data-run-id"] for f in failures] == ["20261103-010000-aaaa", "20261102-010000-aaaa"]
    assert all(f["data-example"] == "tiny-qwen3-moe-nvfp4" for f in failures)
    assert "interrupted in export" in proc.stdout and "lower_bound 0.99" in proc.stdout
    first_failure = dom.find("div", id="failure-1")[0][0]
    assert first_failure < dom.find("section", id="latest")[0][0]
    links = [a["href"] for _, a in dom.find("a") if a.get("href", "").endswith("20261102-010000-aaaa")]
    assert links and os.path.isdir(os.path.join(os.path.dirname(index), links[0]))   # link to the run dir
    assert "20261031-010000-aaaa" in proc.stdout and "(no longer on disk)" not in proc.stdout  # it passed

    # every example's row, failing example first
    rows = [a for _, a in dom.find("tr") if a.get("class") == "latest-row"]
    assert [(r["data-example"], r["data-failed"]) for r in rows] == [
        ("tiny-qwen3-moe-nvfp4", "yes"), ("tiny-qwen3-moe-fp8", "no")]

    # every plot's image loaded
    control = dom.find("img", data_plot="control")
    assert len(control) == 1 and control[0][1]["data-natural-width"] == "0"
    imgs = [a for _, a in dom.find("img") if a["data-plot"] != "control"]
    assert len(imgs) == 10 and {a["data-plot"] for a in imgs} == {"accuracy", "drop", "kl", "stage_times", "size_ratio"}
    widths = {a["src"]: int(a.get("data-natural-width", "0")) for a in imgs}
    assert all(w > 0 for w in widths.values()), widths

    # the screenshot, kept as an artifact (with the page and its images)
    os.makedirs(ARTIFACTS, exist_ok=True)
    shot = os.path.join(ARTIFACTS, "report.png")
    if os.path.exists(shot):
        os.remove(shot)
    t0 = time.time()
    proc = chromium("--window-size=1400,2400", f"--screenshot={shot}", "file://" + index)
    shot_s = time.time() - t0
    assert proc.returncode == 0 and os.path.getsize(shot) > 50_000, proc.stderr[-3000:]
    shutil.copytree(os.path.dirname(index), os.path.join(ARTIFACTS, "page"), dirs_exist_ok=True)
    with open(os.path.join(ARTIFACTS, "timings.txt"), "w") as f:
        f.write(f"dump-dom {dump_s:.1f} s, screenshot {shot_s:.1f} s\n")
