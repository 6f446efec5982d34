"""The built site in a real browser: at 1280 px every code block shows whole, without scrolling sideways.

Headless Chromium (Debian's ``chromium``; tests/rig_setup.sh installs it as root) loads each built page with a
small script added at its end; the script measures every ``pre > code`` and writes what overflows into the DOM,
which ``--dump-dom`` prints. The whole-site check opens every page in one Chromium (its DevTools protocol over
``--remote-debugging-pipe``, the same window size) and reads the same element back: a browser started once
instead of once a page. A screenshot of the hang page is taken as well, for a person to look at.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from test_docs import ROOT, mkdocs_build, needs_mkdocs

WIDTH = 1280
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium to look at the site with (as root: tests/rig_setup.sh, or apt-get install chromium)",
)

# Added at the end of each page: the first line of each block whose text is wider than the block, as JSON in a
# <pre id=...>.
PROBE = """<script>
window.addEventListener("load", () => {
  const cut = [...document.querySelectorAll("pre > code")]
    .filter(c => c.scrollWidth > c.clientWidth + 1)
    .map(c => c.textContent.split("\\n")[0]);
  const out = document.createElement("pre");
  out.id = "width-probe";
  out.textContent = JSON.stringify({blocks: document.querySelectorAll("pre > code").length, cut: cut});
  document.body.appendChild(out);
});
</script>"""
RESULT = re.compile(r'<pre id="width-probe">(.*?)</pre>', re.S)


def chromium(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # --no-sandbox: the suite runs as root in CI, where Chromium's sandbox refuses to start
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         f"--user-data-dir={cwd / 'profile'}", f"--window-size={WIDTH},1000", *args],
        capture_output=True, text=True, timeout=60, cwd=cwd, env={**os.environ, "HOME": str(cwd)},
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    r = mkdocs_build(ROOT / "mkdocs.yml", site)
    assert r.returncode == 0, r.stderr[-4000:]
    return site


def cut_blocks(page: Path, work: Path) -> dict:
    probed = page.with_name("probed.html")
    probed.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    r = chromium("--virtual-time-budget=5000", "--dump-dom", probed.as_uri(), cwd=work)
    found = RESULT.search(r.stdout)
    assert found, f"chromium printed no measurement for {page} (exit {r.returncode}): {r.stderr[-2000:]}"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">")
                      .replace("&amp;", "&"))


class OneBrowser:
    """One headless Chromium, as :func:`chromium` starts it, driven over ``--remote-debugging-pipe`` (the DevTools
    protocol on fds 3 and 4, each message JSON ended by a NUL): each page in its own tab, :data:`PROBE`'s result
    read back from the page's DOM once its load event wrote it. Closed, and waited for, on leaving."""

    def __init__(self, work: Path) -> None:
        self.work, self.sent, self.buffer = work, 0, b""

    def __enter__(self) -> OneBrowser:
        theirs_in, ours_out = os.pipe()  # Chromium reads its commands on fd 3
        ours_in, theirs_out = os.pipe()  # and writes its answers on fd 4

        def as_fds_3_and_4() -> None:  # by way of fds above 4, so that neither end is overwritten by the other
            high_in, high_out = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (theirs_in, theirs_out))
            os.dup2(high_in, 3)
            os.dup2(high_out, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
             f"--user-data-dir={self.work / 'profile'}", f"--window-size={WIDTH},1000", "--remote-debugging-pipe",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.work, env={**os.environ, "HOME": str(self.work)},
            pass_fds=(3, 4, theirs_in, theirs_out), preexec_fn=as_fds_3_and_4)
        os.close(theirs_in)
        os.close(theirs_out)
        self.commands, self.answers = os.fdopen(ours_out, "wb"), ours_in
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.call("Browser.close")
            self.proc.wait(timeout=30)
        except (OSError, RuntimeError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            self.commands.close()
            os.close(self.answers)

    def call(self, method: str, session: str | None = None, **params) -> dict:
        self.sent += 1
        message = {"id": self.sent, "method": method, "params": params, **({"sessionId": session} if session else {})}
        self.commands.write(json.dumps(message).encode() + b"\0")
        self.commands.flush()
        while True:
            while b"\0" not in self.buffer:
                chunk = os.read(self.answers, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"chromium closed its DevTools pipe (exit {self.proc.poll()})")
                self.buffer += chunk
            line, self.buffer = self.buffer.split(b"\0", 1)
            answer = json.loads(line)
            if answer.get("id") == self.sent:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer["result"]

    def probe(self, page: Path, timeout_s: float = 60) -> dict:
        """:func:`cut_blocks`'s measurement of ``page``, in a new tab of this browser."""
        probed = page.with_name("probed.html")
        probed.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
        target = self.call("Target.createTarget", url=probed.as_uri())["targetId"]
        session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                found = self.call("Runtime.evaluate", session, returnByValue=True,
                                  expression="document.getElementById('width-probe')?.textContent ?? null")
                if found["result"].get("value") is not None:
                    return json.loads(found["result"]["value"])
                assert time.monotonic() < deadline, f"chromium measured nothing in {page} in {timeout_s} s"
                time.sleep(0.05)
        finally:
            self.call("Target.closeTarget", targetId=target)


@needs_mkdocs
@needs_chromium
@pytest.mark.timeout(600)
def test_every_code_block_shows_whole_at_1280_px(site: Path, tmp_path: Path):
    pages = sorted(p for p in site.rglob("index.html") if p.parent.name not in ("404", "search"))
    assert len(pages) > 20
    cut, blocks = {}, 0
    with OneBrowser(tmp_path) as browser:
        for page in pages:
            seen = browser.probe(page)
            blocks += seen["blocks"]
        if seen["cut"]:
                cut[str(page.parent.relative_to(site))] = seen["cut"]
    assert blocks > 100, f"only {blocks} code blocks measured: is the probe running?"
    assert not cut, f"code blocks wider than the page at {WIDTH} px (their first line): {cut}"


@needs_mkdocs
@needs_chromium
@pytest.mark.timeout(120)
def test_the_hang_verdict_wraps_inside_its_block(site: Path, tmp_path: Path):
    """The verdict's lines end in what matters (`called from plain_hang.py:35`); the proof that the CSS is what
    shows them is that the theme alone cuts the same block."""
    page = site / "hangs" / "index.html"
    assert cut_blocks(page, tmp_path)["cut"] == []
    css = site / "stylesheets" / "extra.css"
    css.write_text("")  # the theme alone
    try:
        assert any("plain_hang.py" in first for first in cut_blocks(page, tmp_path)["cut"])
    finally:
        shutil.copy2(ROOT / "docs" / "stylesheets" / "extra.css", css)
    shot = tmp_path / "hangs.png"
    r = chromium(f"--screenshot={shot}", page.as_uri(), cwd=tmp_path)
    assert shot.exists() and shot.stat().st_size > 10_000, r.stderr[-2000:]
