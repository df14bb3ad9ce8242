"""report.html as a person sees it: `pip install "flake8-amp[runtime]"` draws its plots, and
a real headless browser (Debian's chromium) shows every one of them without loading anything
from outside the page."""
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from amp_runtime.html_report import build_report

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
#: Appended to a copy of the page: after it loaded, the body says how many images the
#: browser decoded and which resources it fetched (data: images are not fetched).
PROBE = """<script>window.addEventListener("load", () => {
  const images = [...document.images];
  document.body.setAttribute("data-decoded", JSON.stringify(
    [images.filter(i => i.complete && i.naturalWidth > 0).length, images.length]));
  document.body.setAttribute("data-fetched", JSON.stringify(
    performance.getEntriesByType("resource").map(r => r.name)));
});</script>"""


def test_the_runtime_extra_installs_what_draws_the_plots():
    requirements = importlib.metadata.requires("flake8-amp") or []
    runtime = [r for r in requirements if re.search(r"""extra\s*==\s*["']runtime["']""", r)]
    assert any(r.startswith("matplotlib") for r in runtime), runtime


@pytest.fixture(scope="module")
def overflow_logs(tmp_path_factory):
    """The logs and report of the bundled overflowing example under `amp_runtime run`."""
    out = tmp_path_factory.mktemp("run") / "amp-report"
    result = subprocess.run(
        [sys.executable, "-m", "amp_runtime", "run", "--out", str(out),
         str(ROOT / "examples" / "train_overflow.py"), "--steps", "24"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return out


def _show(page: Path, tmp_path: Path) -> dict:
    """Open a probed copy of ``page`` in headless chromium; what the probe saw."""
    probed = tmp_path / f"probed-{page.parent.name}.html"
    probed.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"),
                      encoding="utf-8")
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--no-first-run",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000",
         "--dump-dom", probed.as_uri()],
        capture_output=True, text=True, timeout=120)
    dom = result.stdout
    decoded = re.search(r'data-decoded="([^"]*)"', dom)
    fetched = re.search(r'data-fetched="([^"]*)"', dom)
    assert decoded and fetched, f"the page did not load in chromium: {result.stderr[-2000:]}"
    unescape = (lambda text: json.loads(text.replace("&quot;", '"')))
    return {"decoded": unescape(decoded.group(1)), "fetched": unescape(fetched.group(1))}


def _drawn_plots(page: Path) -> int:
    return page.read_text(encoding="utf-8").count('<figure class="plot" ')


def _no_external_url(page: Path):
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"(https?:|ftp:)?//[\w.-]+\.\w", text), "the page names a URL"
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:|#)""", text)


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install chromium); "
                                             "tests/run.sh installs it in CI")
def test_a_browser_shows_every_plot_of_a_run_and_fetches_nothing(overflow_logs, tmp_path):
    page = overflow_logs / "report.html"
    _no_external_url(page)
    seen = _show(page, tmp_path)
    decoded, images = seen["decoded"]
    # loss, loss scale, gradient norm, heat map, timeline (no gradient underflowed)
    assert decoded == images == _drawn_plots(page) >= 5
    assert seen["fetched"] == []


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install chromium); "
                                             "tests/run.sh installs it in CI")
def test_a_browser_shows_the_page_over_several_ranks(overflow_logs, tmp_path):
    base = tmp_path / "ddp"
    for rank in (0, 1):
        shutil.copytree(overflow_logs, base / f"rank-{rank}")
    page = build_report(base)
    _no_external_url(page)
    seen = _show(page, tmp_path)
    decoded, images = seen["decoded"]
    assert decoded == images == _drawn_plots(page) >= 10
    assert seen["fetched"] == []
