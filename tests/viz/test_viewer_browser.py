"""The HTML viewer as a person uses it: headless Chromium opens it from file://, switches layer
and head, hovers a token, clicks a cell for its score's terms, and we check what is drawn and the
numbers shown, that no request left the page, that the console stayed clean, and that a hostile
token renders as text. A screenshot is kept.

The browser is driven over the Chrome DevTools Protocol on a pipe (``--remote-debugging-pipe``:
JSON messages separated by NUL bytes on file descriptors 3 and 4), so no Python package and no
driver binary are needed, only Debian's ``chromium``. With ``CI`` set, a missing browser fails.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from attnkit.analysis import score_terms
from attnkit.viz import write_viewer
from tests.support.tolerances import close
from tests.viz.test_viewer_terms import recorded_model

pytestmark = pytest.mark.browser

EVIL = "</script><img src=x onerror=alert(1)>"
TOKENS = ["[CLS]", "the", "river", "bank", "was", "eroding", ".", "[SEP]", EVIL]
LAYER, HEAD, BANK, RIVER = 2, 5, 3, 2
HEAD_COLOR = (0x8C, 0x56, 0x4B)  # COLORS[5] in the viewer
TIMEOUT = 30.0


def _chromium() -> str | None:
    for name in (os.environ.get("ATTNKIT_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class Browser:
    """A headless Chromium and one page, spoken to over the DevTools pipe."""

    def __init__(self, exe: str, profile: Path):
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire_fds():  # the browser reads commands on fd 3 and writes replies on fd 4
            hi_r, hi_w = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        args = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--mute-audio", f"--user-data-dir={profile}",
                "--remote-debugging-pipe", "--window-size=1280,900", "about:blank"]
        # preexec_fn runs before the child closes all but pass_fds, so 3 and 4 survive.
        self.proc = subprocess.Popen(args, preexec_fn=wire_fds, pass_fds=(3, 4),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self._cv = threading.Condition()
        self.events: queue.Queue = queue.Queue()
        self.log: list[dict] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Network", "Log"):
            self.page(f"{domain}.enable")
        self.page("Emulation.setDeviceMetricsOverride", width=1280, height=900, deviceScaleFactor=1, mobile=False)

    def _read(self) -> None:
        buf = b""
        while True:
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self._cv:
                        self._replies[msg["id"]] = msg
                        self._cv.notify_all()
                else:
                    self.log.append(msg)
                    self.events.put(msg)

    def call(self, method: str, session: str | None = None, **params):
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + TIMEOUT
        with self._cv:
            while self._next_id not in self._replies:
                if not self._cv.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"no reply to {method} within {TIMEOUT} s")
            reply = self._replies.pop(self._next_id)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def page(self, method: str, **params):
        return self.call(method, session=self.session, **params)

    def js(self, expression: str):
        r = self.page("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"JS failed: {expression[:80]}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def open(self, url: str) -> None:
        self.page("Page.navigate", url=url)
        self.wait_for("document.body && document.body.dataset.ready === '1'")

    def wait_for(self, expression: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                if self.js(expression):
                    return
            except RuntimeError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"timed out waiting for {expression}")

    def center(self, selector: str) -> tuple[float, float]:
        r = self.js(f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
                    " e.scrollIntoView({block: 'center'}); const b = e.getBoundingClientRect();"
                    " return [b.left + b.width / 2, b.top + b.height / 2]; })()")
        return r[0], r[1]

    def click_at(self, x: float, y: float) -> None:
        self.page("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.page("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def hover(self, selector: str) -> None:
        x, y = self.center(selector)
        self.page("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def click(self, selector: str) -> None:
        x, y = self.center(selector)
        self.page("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.page("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def pixel(self, canvas: str, x: int, y: int) -> list[int]:
        return self.js(f"Array.from(document.querySelector({json.dumps(canvas)}).getContext('2d')"
                       f".getImageData({x}, {y}, 1, 1).data)")

    def screenshot(self, path: Path) -> Path:
        import base64

        data = self.page("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def requests(self) -> list[str]:
        return [m["params"]["request"]["url"] for m in self.log if m.get("method") == "Network.requestWillBeSent"]

    def errors(self) -> list[str]:
        out = []
        for m in self.log:
            method, p = m.get("method"), m.get("params", {})
            if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
                out.append(f"console.{p['type']}: {p.get('args')}")
            elif method == "Runtime.exceptionThrown":
                out.append(f"exception: {p.get('exceptionDetails')}")
            elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(f"log: {p['entry'].get('text')}")
            elif method == "Page.javascriptDialogOpening":
                out.append(f"dialog: {p.get('message')}")
        return out

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except Exception:  # noqa: BLE001 - the browser may already be gone
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    exe = _chromium()
    if exe is None:
        msg = "headless Chromium not found (apt-get install chromium, or set ATTNKIT_CHROMIUM)"
        if os.environ.get("CI"):
            pytest.fail(msg + "; CI must run this test")
        pytest.skip(msg)
    b = Browser(exe, tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


def _attentions(n_layers: int = 6, n_heads: int = 12, n: int = len(TOKENS)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    layers = [torch.softmax(torch.randn(1, n_heads, n, n, generator=g), dim=-1) for _ in range(n_layers)]
    # One planted link: layer 2, head 5, "bank" puts 0.9 on "river", the rest on "[SEP]".
    row = torch.zeros(n)
    row[RIVER], row[7] = 0.9, 0.1
    layers[LAYER][0, HEAD, BANK] = row
    return layers


def _keep(shot: Path) -> None:
    artifacts = os.environ.get("ARTIFACTS") or ("artifacts" if Path("artifacts").is_dir() else None)
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(artifacts) / shot.name)


def test_viewer_in_headless_chromium(browser, tmp_path):
    page = write_viewer(tmp_path / "viewer.html", _attentions(), TOKENS, text="The river bank was eroding.")
    url = page.resolve().as_uri()
    browser.open(url)
    assert browser.js("document.body.dataset.layer") == "0"

    # Switch layer with the select, then pick head 5 alone with real clicks on the checkboxes.
    browser.js(f"(() => {{ const s = document.getElementById('layer'); s.value = '{LAYER}';"
               " s.dispatchEvent(new Event('change')); })()")
    browser.click("#no-heads")
    browser.click(f"#head-{HEAD}")
    assert browser.js("document.body.dataset.layer") == str(LAYER)
    assert browser.js("document.body.dataset.heads") == str(HEAD)

    # Hover "bank" among the queries: its strongest link is "river" at 0.9.
    browser.hover(f'#left .tok[data-i="{BANK}"]')
    assert browser.js("document.body.dataset.hover") == f"q:{BANK}"
    top = browser.js("(() => { const li = document.querySelector('#info-list li');"
                     " return [li.dataset.head, li.dataset.topKey, li.dataset.topWeight, li.textContent]; })()")
    assert top[0] == str(HEAD) and top[1] == str(RIVER)
    assert abs(float(top[2]) - 0.9) <= 1 / 255 + 1e-9
    assert "river" in top[3]
    drawn = browser.js("window.attnkit.state.drawn")
    assert {(d["q"], d["k"]) for d in drawn} == {(BANK, RIVER), (BANK, 7)}
    # The line bank -> river is painted in head 5's colour halfway across the canvas; away from it, nothing.
    row_h = 20
    mid_y = (BANK * row_h + row_h / 2 + RIVER * row_h + row_h / 2) / 2
    r, g, b, a = browser.pixel("#lines", 120, int(mid_y))
    assert a > 150 and abs(r - HEAD_COLOR[0]) < 40 and abs(g - HEAD_COLOR[1]) < 40 and abs(b - HEAD_COLOR[2]) < 40
    assert browser.pixel("#lines", 120, 5 * row_h)[3] == 0
    # The key "river" is shaded by its weight; an unlinked key is not.
    assert browser.js(f"document.querySelector('#right .tok[data-i=\"{RIVER}\"]').style.background") != ""
    assert browser.js("document.querySelector('#right .tok[data-i=\"4\"]').style.background") == ""
    shot = browser.screenshot(tmp_path / "viewer_head_view.png")
    _keep(shot)

    # Matrix view: the cell (bank, river) is dark, (bank, was) is white.
    browser.click('#views button[data-view="matrix"]')
    assert browser.js("document.body.dataset.view") == "matrix"
    geom = browser.js("(() => { const c = document.getElementById('matrix'); return [c.width, c.height]; })()")
    n = len(TOKENS)
    pad, cell = 90, max(1, 560 // n)
    assert geom == [pad + n * cell] * 2
    dark = browser.pixel("#matrix", pad + RIVER * cell + cell // 2, pad + BANK * cell + cell // 2)
    light = browser.pixel("#matrix", pad + 4 * cell + cell // 2, pad + BANK * cell + cell // 2)
    assert dark[0] < 60 and dark[3] == 255
    assert light[:3] == [255, 255, 255]

    # Model view: every layer x head; clicking a thumbnail opens it in the head view.
    browser.click('#views button[data-view="model"]')
    assert browser.js("document.querySelectorAll('.thumb canvas').length") == 6 * 12
    browser.click('.thumb[data-layer="4"][data-head="1"]')
    assert [browser.js(f"document.body.dataset.{k}") for k in ("view", "layer", "heads")] == ["head", "4", "1"]

    # The hostile token is text: no <img> was created, no dialog opened, the text is intact.
    assert browser.js("document.querySelectorAll('img, iframe, object, embed').length") == 0
    texts = browser.js("Array.from(document.querySelectorAll('#left .tok'), e => e.textContent)")
    assert texts[-1] == EVIL
    assert browser.js("document.scripts.length") == 2

    # Nothing but the page itself was requested, and the console stayed clean.
    assert browser.requests() and set(browser.requests()) == {url}
    assert browser.errors() == []


def test_long_input_stays_usable(browser, tmp_path):
    n = 300
    tokens = [f"tok{i}" for i in range(n)]
    att = _attentions(n_layers=3, n_heads=6, n=n)
    page = write_viewer(tmp_path / "long.html", att, tokens, max_dense_cells=100_000, top_k=16)
    assert page.stat().st_size < 1_000_000
    url = page.resolve().as_uri()
    browser.log.clear()
    browser.open(url)
    assert "strongest keys" in browser.js("document.getElementById('note').textContent")
    # Without hovering, each query draws at most its 3 strongest links.
    assert len(browser.js("window.attnkit.state.drawn")) <= 3 * n
    browser.hover('#left .tok[data-i="150"]')
    drawn = browser.js("window.attnkit.state.drawn")
    assert drawn and all(d["q"] == 150 for d in drawn) and len(drawn) <= 16
    browser.click('#views button[data-view="matrix"]')
    assert browser.js("document.getElementById('matrix').width") == n  # one pixel a cell under 512
    assert set(browser.requests()) == {url}
    assert browser.errors() == []


def _click_cell(browser: Browser, q: int, k: int, n: int) -> None:
    """Click the matrix cell of query ``q`` and key ``k`` (one cell a token: ``n`` <= 64 tokens)."""
    pad, cell = 90, max(1, 560 // n)
    left, top = browser.js("(() => { const c = document.getElementById('matrix'); c.scrollIntoView({block: 'center'});"
                           " const b = c.getBoundingClientRect(); return [b.left, b.top]; })()")
    browser.click_at(left + pad + k * cell + cell / 2, top + pad + q * cell + cell / 2)


def _panel(browser: Browser) -> dict:
    return browser.js("""(() => {
      const box = document.getElementById('terms');
      const terms = (sel) => Array.from(document.querySelectorAll(sel),
                                        e => [Number(e.dataset.dim), Number(e.dataset.term)]);
      return { hidden: box.hidden, data: Object.assign({}, box.dataset),
               bars: terms('#terms-chart rect'), top: terms('#terms-top li'),
               labels: Array.from(document.querySelectorAll('#terms-chart text[data-dim]'), t => Number(t.dataset.dim)),
               title: document.getElementById('terms-title').textContent,
               sum: document.getElementById('terms-sum').textContent,
               shownScore: (document.querySelector('#terms-sum b') || {}).textContent,
               weight: document.getElementById('terms-weight').textContent };
    })()""")


def test_clicking_a_cell_shows_its_score_terms(browser, tmp_path):
    weights, qk = recorded_model()  # 3 layers x 4 heads, 2 key heads: rotary + causal, plain, ALiBi
    n = len(TOKENS)
    url = write_viewer(tmp_path / "terms.html", weights, TOKENS, qk=qk).resolve().as_uri()
    browser.log.clear()
    browser.open(url)
    assert browser.js("document.getElementById('terms').hidden") is True
    browser.click("#no-heads")
    browser.click("#head-1")
    browser.click("#head-3")
    browser.click('#views button[data-view="matrix"]')
    _click_cell(browser, BANK, RIVER, n)
    assert browser.js("document.body.dataset.cell") == f"{BANK}:{RIVER}"
    cell = 560 // n  # the clicked cell is outlined in orange
    r, g, b, _ = browser.pixel("#matrix", 90 + RIVER * cell + 1, 90 + BANK * cell + cell // 2)
    assert r > 200 and 120 < g < 200 and b < 60

    def check(layer: int, head: int, query: int, key: int) -> dict:
        p = _panel(browser)
        assert not p["hidden"]
        assert [p["data"][k] for k in ("layer", "head", "query", "key")] == [str(v) for v in (layer, head, query, key)]
        q, k, scale = qk[layer]
        expected = score_terms(q.double(), k.double(), scale=scale, query=query)[0, head, key]  # (D,)
        bars = p["bars"]
        # every dimension once, largest magnitude first, each term the float64 product of the recorded q and k
        assert sorted(d for d, _ in bars) == list(range(expected.numel()))
        assert [abs(t) for _, t in bars] == sorted((abs(t) for _, t in bars), reverse=True)
        close(torch.tensor([t for _, t in sorted(bars)], dtype=torch.float64), expected)
        assert p["labels"] == [d for d, _ in bars[:5]] and p["top"] == bars[:5]
        # the score shown is their sum, and in the text to 4 places
        score = float(p["data"]["score"])
        close(torch.tensor(score, dtype=torch.float64), expected.sum())
        assert p["shownScore"] == f"{score:.4f}" and f"sum of the {expected.numel()} terms" in p["sum"]
        return p

    # Layer 0, the first selected head: the weight is the softmax of the row's scores, as the model computed it
    p = check(0, 1, BANK, RIVER)
    assert p["data"]["softmax"] == "1" and "softmax of the row" in p["weight"]
    close(torch.tensor(float(p["data"]["weight"])), weights[0][0, 1, BANK, RIVER])
    # Another head from the panel's own menu: head 3 reads key head 1
    browser.js("(() => { const s = document.getElementById('terms-head'); s.value = '3';"
               " s.dispatchEvent(new Event('change')); })()")
    p = check(0, 3, BANK, RIVER)
    close(torch.tensor(float(p["data"]["weight"])), weights[0][0, 3, BANK, RIVER])
    shot = browser.screenshot(tmp_path / "viewer_score_terms.png")
    _keep(shot)
    # A key the causal mask hides: its score exists, its weight is 0
    _click_cell(browser, RIVER, BANK, n)
    p = check(0, 3, RIVER, BANK)
    assert p["data"]["weight"] == "0" and "masked" in p["weight"]
    # Layer 2 adds ALiBi to its scores: the panel says so and shows the map's weight
    browser.js("(() => { const s = document.getElementById('layer'); s.value = '2';"
               " s.dispatchEvent(new Event('change')); })()")
    p = check(2, 3, RIVER, BANK)
    assert p["data"]["softmax"] == "0" and "not the softmax" in p["weight"]
    assert abs(float(p["data"]["weight"]) - float(weights[2][0, 3, RIVER, BANK])) <= 0.5 / 255 + 1e-7
    # The hostile token is text in the panel's title
    _click_cell(browser, n - 1, 0, n)
    assert EVIL in check(2, 3, n - 1, 0)["title"]
    assert browser.js("document.querySelectorAll('img, iframe, object, embed').length") == 0
    assert set(browser.requests()) == {url}
    assert browser.errors() == []

    # Without q and k the panel says how to get them
    plain = write_viewer(tmp_path / "plain.html", weights, TOKENS).resolve().as_uri()
    browser.open(plain)
    browser.click('#views button[data-view="matrix"]')
    _click_cell(browser, BANK, RIVER, n)
    p = _panel(browser)
    assert not p["hidden"] and p["bars"] == [] and "qk=" in p["sum"]
    assert browser.errors() == []
