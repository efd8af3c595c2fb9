"""The web extension in a real headless Chromium against a real ComfyUI serving its real frontend, once per
frontend and node mode (conftest.py: ComfyUI's own frontend, those in ATTN_DISPATCH_FRONTENDS, the classic canvas
and "Modern Node Design (Nodes 2.0)"; ids such as fe1.58.1-nodes2).

Needs COMFYUI_PATH (as tests/integration), Debian's `chromium` (CHROMIUM overrides the path) and the
`playwright` Python package (its own browsers are never downloaded: executable_path is Debian's).
Without COMFYUI_PATH they skip (helpers/comfyui.py); with it, a missing browser or package fails them.
The screenshot of the nodes with their badges lands in the test's tmp dir and is copied to
$ATTN_DISPATCH_SCREENSHOT, by default tests/web/artifacts/web-report.png (git-ignored; CI prints its path).
More land in tests/web/artifacts/, named after the frontend and mode: dropdown-*.png (the open dropdown),
dropdown-order.png (the groups, in order), panel-no-overlap-*.png (a node's panel, the node below moved down with
its badge row clear of it), refused-*.png (a refused prompt: the widgets at fault, the panel's sentences) and
badges-*.png (badges and panels after a run); the tests assert what they show.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import ARGS, CHROMIUM, frontend_params, playwright_for

pytestmark = pytest.mark.integration

SETTINGS = {"policy": "AttentionDispatch.DefaultPolicy", "show": "AttentionDispatch.ShowUnavailableBackends",
            "toast": "AttentionDispatch.FallbackToast"}
APP = "window.comfyAPI.app.app"
VUE_OPTIONS = "[data-testid=widget-select-default-overlay] [role=option]"
VUE_VIEWPORT = "[data-testid=widget-select-default-viewport]"
# The page is ready once the extension has loaded the backend list (app.extensions throws until Pinia is up).
READY = """() => { try { const app = window.comfyAPI?.app?.app;
    const ext = app?.extensions?.find((e) => e.name === 'attention_dispatch');
    return !!app?.graph && !!app?.canvas && ext?.attentionDispatch?.state?.version > 0; } catch { return false; } }"""
API = "window.comfyAPI.api.api"


ARTIFACTS = Path(__file__).resolve().parent / "artifacts"


def _screenshot_target() -> Path:
    return Path(os.environ.get("ATTN_DISPATCH_SCREENSHOT") or ARTIFACTS / "web-report.png")


def _cond(seed):
    return {"class_type": "TestRandomConditioning", "inputs": {"seed": seed, "length": 8, "dim": 4096,
                                                                 "pooled_dim": 768}}


def wan_prompt(backends):
    """UNETLoader (tiny WAN) -> Set Attention Backend "1i0" -> KSampler -> SaveLatent, one chain per backend. Seeds of
    its own each call: ComfyUI serves an identical prompt (another page's, on the same server) from its cache, and a
    node served from there sends no report."""
    run = random.randrange(2**31)
    p = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan21.safetensors", "weight_dtype": "default"}},
         "2": _cond(1), "3": _cond(2),
         "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1,
                                                                   "batch_size": 1}}}
    for i, backend in enumerate(backends):
        s, k, o = f"1{i}0", f"1{i}1", f"1{i}2"
        p[s] = {"class_type": "SetAttentionBackend", "inputs": {"model": ["1", 0], "backend": backend,
                                                                "policy": "fallback", "start_percent": 0.0,
                                                                "end_percent": 1.0}}
        p[k] = {"class_type": "KSampler", "inputs": {
            "model": [s, 0], "seed": run + i, "steps": 2, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}}
        p[o] = {"class_type": "SaveLatent", "inputs": {"samples": [k, 0], "filename_prefix": f"latents/web_{i}"}}
    # The text-encoder node: a 2-layer CLIP-L from the test helper pack.
    p["20"] = {"class_type": "TestTinyClip", "inputs": {"seed": run}}
    p["21"] = {"class_type": "SetClipAttentionBackend", "inputs": {"clip": ["20", 0], "backend": "native",
                                                                   "policy": "fallback"}}
    p["22"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": ["21", 0], "text": "a browser test"}}
    p["23"] = {"class_type": "TestConditioningStats", "inputs": {"conditioning": ["22", 0]}}
    return p


class Page:
    """A page of the ComfyUI frontend plus what it logged and fetched."""

    def __init__(self, page):
        self.page = page
        self.logs: list[str] = []
        self.errors: list[str] = []
        self.backend_fetches = 0
        page.on("console", lambda m: self.logs.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: self.errors.append(f"{e}\n{getattr(e, 'stack', '')}"))
        page.on("request", self._request)

    def _request(self, request):
        if "/attention_dispatch/backends" in request.url:
            self.backend_fetches += 1

    def js(self, script, arg=None):
        return self.page.evaluate(script, arg)

    def add_node(self, node_type="SetAttentionBackend", pos=(220, 160)):
        """Clear the graph and add one node through the frontend's JS API; window.__adNode is that node."""
        node_id = self.js(f"""([type, pos]) => {{ const app = {APP};
            app.graph.clear();
            const n = LiteGraph.createNode(type); n.pos = pos; app.graph.add(n);
            app.canvas.ds.scale = 1; app.canvas.ds.offset = [0, 0]; app.canvas.setDirty(true, true);
            window.__adNode = n; return n.id; }}""", [node_type, list(pos)])
        self.frames()
        return node_id

    def frames(self, n=3):
        """Let the canvas draw (widgets get their y positions when the node is first drawn)."""
        self.js("""async (n) => { for (let i = 0; i < n; i++) await new Promise((r) => requestAnimationFrame(r)); }""", n)

    def widget_center(self, name):
        return self.js(f"""(name) => {{ const app = {APP}; const n = window.__adNode;
            const w = n.widgets.find((w) => w.name === name);
            const p = app.canvas.ds.convertCanvasToOffset([n.pos[0] + n.size[0] / 2,
                                                           n.pos[1] + w.y + (w.computedHeight || 24) / 2]);
            const r = app.canvas.canvas.getBoundingClientRect();
            return [r.left + p[0], r.top + p[1]]; }}""", name)

    def open_dropdown(self, name="backend"):
        """A real mouse click on the combo widget: the frontend opens its LiteGraph context menu, or in Nodes 2.0 its
        select (entries: value, the label it shows)."""
        if self.mode == "nodes2":
            return self.open_vue_dropdown(name)
        self.close_menus()
        x, y = self.widget_center(name)
        self.page.mouse.click(x, y)
        try:
            self.page.wait_for_selector(".litecontextmenu .litemenu-entry", timeout=10000)
        except Exception:
            self.page.screenshot(path=str(self.shots / "no-dropdown.png"))
            raise AssertionError(f"no dropdown after a click at {x:.0f},{y:.0f}; see {self.shots / 'no-dropdown.png'}")
        return self.js("""() => [...document.querySelectorAll('.litecontextmenu .litemenu-entry')].map((e) => ({
            value: typeof e.value === 'string' ? e.value : e.dataset.value, text: e.textContent, title: e.title,
            mark: e.dataset.attentionDispatch || null }))""")

    def open_vue_dropdown(self, name):
        """Nodes 2.0's select renders only the entries in view (a virtual list): scroll it through, gather each
        label once, and pair them with the values by the widget's own getOptionLabel."""
        self.page.keyboard.press("Escape")
        node_id = self.js("() => window.__adNode.id")
        trigger = self.page.locator(f"[data-node-id='{node_id}'] [data-testid=widget-select-default-trigger]"
                                    f"[aria-label='{name}']")
        trigger.click()
        self.page.wait_for_selector(VUE_OPTIONS, timeout=10000)
        labels = self.js(f"""async () => {{ const vp = document.querySelector(VUE_VIEWPORT), seen = [];
            const frame = () => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
            vp.scrollTop = 0;
            for (let i = 0; i < 200; i++) {{
                await frame();
                for (const e of document.querySelectorAll('{VUE_OPTIONS}')) {{
                    const t = e.textContent.trim(); if (!seen.includes(t)) seen.push(t); }}
                if (vp.scrollTop + vp.clientHeight >= vp.scrollHeight - 1) break;
                vp.scrollTop += Math.max(16, vp.clientHeight / 2);
            }}
            vp.scrollTop = 0; await frame(); return seen; }}""".replace("VUE_VIEWPORT", repr(VUE_VIEWPORT)))
        pairs = self.js(f"""() => {{ const w = window.__adNode.widgets.find((w) => w.name === '{name}');
            return w.options.values.map((v) => [v, w.options.getOptionLabel ? w.options.getOptionLabel(v) : v]); }}""")
        return [{"value": v, "text": label, "title": "", "mark": None} for v, label in pairs if label in labels]

    def pick_vue_option(self, text):
        """Scroll Nodes 2.0's open select until the entry whose label starts with `text` is rendered; click it."""
        self.js(f"""async (text) => {{ const vp = document.querySelector({VUE_VIEWPORT!r});
            const frame = () => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
            vp.scrollTop = 0;
            for (let i = 0; i < 200; i++) {{
                await frame();
                const hit = [...document.querySelectorAll('{VUE_OPTIONS}')]
                    .find((e) => e.textContent.trim().startsWith(text));
                if (hit) {{ hit.scrollIntoView({{block: 'nearest'}}); await frame(); return; }}
                vp.scrollTop += Math.max(16, vp.clientHeight / 2);
            }} }}""", text)
        self.page.locator(VUE_OPTIONS, has_text=text).first.click()

    def close_menus(self):
        if self.mode == "nodes2":
            self.page.keyboard.press("Escape")
            return
        if self.js("() => document.querySelectorAll('.litecontextmenu').length"):
            self.page.keyboard.press("Escape")
            if self.js("() => document.querySelectorAll('.litecontextmenu').length"):
                self.page.mouse.click(900, 850)
        self.page.wait_for_function("() => !document.querySelector('.litecontextmenu')", timeout=5000)

    def node_state(self, node="window.__adNode"):
        return self.js(f"""() => {{ const n = {node}; const st = n.attention_dispatch;
            const w = n.widgets.find((w) => w.name === 'backend');
            return {{ value: w.value, display: w._displayValue, tooltip: w.tooltip || '',
                     policy: n.widgets.find((w) => w.name === 'policy').value,
                     warning: st.warning, badge: st.badgeText, summary: st.summary,
                     panel: (st.layout || []).map((b) => b.lines.join('\\n')) }}; }}""")

    def set_setting(self, key, value):
        self.js(f"async ([id, v]) => {{ await {APP}.extensionManager.setting.set(id, v); }}", [SETTINGS[key], value])


def _post_setting(comfy, key, value):
    req = urllib.request.Request(f"{comfy.url}/settings/{key}", data=json.dumps(value).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200


@pytest.fixture(scope="module", params=frontend_params())
def ui(request, tmp_path_factory, frontend_servers):
    frontend, mode = request.param
    sync_api = playwright_for(frontend)
    comfy = frontend_servers(frontend)  # after the checks: no ComfyUI start when the browser is missing
    # A fresh user dir opens the "Get Started with a Template" dialog over the canvas: mark it seen. The node mode is
    # a user setting, read when the page loads.
    _post_setting(comfy, "Comfy.TutorialCompleted", True)
    _post_setting(comfy, "Comfy.VueNodes.Enabled", mode == "nodes2")
    profile = tempfile.mkdtemp(prefix="attn-dispatch-chromium-")
    try:
        with sync_api.sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                profile, executable_path=CHROMIUM, headless=True, args=ARGS,
                viewport={"width": 1600, "height": 1000})
            try:
                context.set_default_timeout(60000)
                page = Page(context.pages[0] if context.pages else context.new_page())
                page.comfy, page.mode, page.frontend = comfy, mode, frontend
                page.tag = f"fe{frontend.version}-{mode}"
                started = time.time()
                page.page.goto(comfy.url)
                page.page.wait_for_function(READY, timeout=90000)
                # The frontend's own start-up graph (1.53: a Z-Image template) is scanned for missing models by
                # requests that can end after a test loaded its own workflow, and the scan's result then stays:
                # "Missing Models: qwen_3_4b" counted with a test's own error. Let the start-up requests end first.
                try:
                    page.page.wait_for_load_state("networkidle", timeout=30000)
                except sync_api.TimeoutError:
                    pass  # a page that keeps polling: the tests that count errors look at what is whose
                vue = page.js("() => window.LiteGraph?.vueNodesMode === true")
                assert vue == (mode == "nodes2"), (mode, vue)
                page.load_seconds = time.time() - started
                page.shots = tmp_path_factory.mktemp("web-screenshots")
                yield page
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def test_extension_loads_once_and_fetches_the_backends_once(ui):
    comfy = ui.comfy
    state = ui.js(f"""() => {{ const ext = {APP}.extensions.find((e) => e.name === 'attention_dispatch');
        const s = ext.attentionDispatch.state; return {{ error: s.error, names: [...s.index.keys()],
        machine: s.machine }}; }}""")
    route = comfy.get("/attention_dispatch/backends")
    assert state["error"] is None
    assert state["names"] == [b["name"] for b in route["backends"]]
    assert state["machine"]["device_type"] == route["machine"]["device_type"]
    assert ui.backend_fetches == 1
    count = ui.js(f"() => {APP}.extensions.filter((e) => e.name === 'attention_dispatch').length")
    assert count == 1
    for key, default in (("policy", "fallback"), ("show", True), ("toast", True)):  # registered in the settings store
        assert ui.js(f"(id) => {APP}.extensionManager.setting.get(id)", SETTINGS[key]) == default


def test_dropdown_marks_what_cannot_run_here(ui):
    comfy = ui.comfy
    route = {b["name"]: b for b in comfy.get("/attention_dispatch/backends")["backends"]}
    assert route["flash"]["available"] is False and route["native"]["available"] is True  # a CPU machine
    ui.add_node()
    entries = {e["value"]: e for e in ui.open_dropdown()}
    _artifact(ui, f"dropdown-{ui.tag}.png")
    options = comfy.get("/object_info/SetAttentionBackend")["SetAttentionBackend"]["input"]["required"]["backend"]
    assert set(entries) == set(options[1]["options"])  # every value listed, under its real name
    for name, row in route.items():
        if name not in entries:
            continue
        if ui.mode == "classic":
            assert entries[name]["mark"] == ("available" if row["available"] else "unavailable"), entries[name]
        assert entries[name]["text"].startswith("\u2713 " if row["available"] else "\u2717 "), entries[name]
    flash = entries["flash"]
    if ui.mode == "classic":
        assert "needs an NVIDIA CUDA GPU" in flash["title"]  # the reason on hover (beside the name: only a reason of
        # its own; the one its family shares is in the family's heading, checked below)
        assert "Install:" not in flash["title"]  # no install command: installing would not make it run on a CPU
        assert all(entries[v]["mark"] == "available" for v in ("auto_exact", "auto_fast", "comfy default"))
        ui.page.locator(".litecontextmenu .litemenu-entry[data-value='flash']").click()
    else:  # Nodes 2.0's select: one label per entry, no hover text (docs/nodes.md)
        assert flash["text"].startswith("\u2717 flash \u2014 needs an NVIDIA CUDA GPU"), flash
        assert all(entries[v]["text"] == v for v in ("auto_exact", "auto_fast", "comfy default")), entries
        ui.pick_vue_option("\u2717 flash \u2014")
    ui.page.wait_for_timeout(300)
    st = ui.node_state()
    assert st["value"] == "flash"  # the value sent with the prompt is the real backend name
    if ui.mode == "classic":
        assert st["display"] == "\u2717 flash"
    else:
        shown = ui.page.locator(f"[data-node-id='{ui.js('() => window.__adNode.id')}'] "
                                "[data-testid=widget-select-default-trigger][aria-label='backend']").inner_text()
        assert shown.startswith("\u2717 flash \u2014"), shown
    assert st["warning"]["text"].startswith("\u26a0 flash cannot run here: needs an NVIDIA CUDA GPU")
    assert "Install:" not in st["warning"]["text"]
    assert "Policy fallback" in st["warning"]["text"]
    assert st["badge"] == "\u26a0 flash unavailable"
    assert st["tooltip"].startswith(st["warning"]["text"])
    ui.page.wait_for_timeout(300)
    st = ui.node_state()
    assert st["panel"] and st["panel"][0].startswith("\u26a0 flash cannot run here")  # drawn on the node
    if ui.mode == "nodes2":  # the panel is the node's own widget there, drawn on a canvas inside the Vue node
        height = ui.js(f"""() => document.querySelector(`[data-node-id='${{window.__adNode.id}}']`)
            .querySelector('canvas')?.getBoundingClientRect().height ?? 0""")
        assert height >= 60, height
    _artifact(ui, f"warning-{ui.tag}.png")
    prompt = ui.js(f"async () => (await {APP}.graphToPrompt()).output")
    (node_prompt,) = [v for v in prompt.values() if v["class_type"] == "SetAttentionBackend"]
    assert node_prompt["inputs"]["backend"] == "flash"

    ui.js("() => { window.__adNode.widgets.find((w) => w.name === 'policy').value = 'strict'; }")
    ui.frames()
    st = ui.node_state()
    assert st["warning"]["strict"] is True and "Policy strict: the prompt will be rejected." in st["warning"]["text"]
    ui.page.screenshot(path=str(ui.shots / "warning.png"))


def _artifact(ui, name):
    """A screenshot kept for people to look at: tests/web/artifacts/<name> (git-ignored)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    ui.page.screenshot(path=str(path))
    return path


def test_dropdown_leads_with_the_autos_and_groups_the_rest(ui):
    """The dropdown in the server's order (autos and ComfyUI's attention, what runs here, the rest by family), each
    group headed (a family with the reason its members share), no private `_` name, and inside the window."""
    if ui.mode == "nodes2":
        pytest.skip("Nodes 2.0's select lists labels only, without group headings (docs/nodes.md)")
    comfy = ui.comfy
    route = {b["name"]: b for b in comfy.get("/attention_dispatch/backends")["backends"]}
    options = comfy.get("/object_info/SetAttentionBackend")["SetAttentionBackend"]["input"]["required"]["backend"]
    ui.add_node(pos=(220, 60))
    entries = ui.open_dropdown()
    shot = _artifact(ui, f"dropdown-order-{ui.tag}.png")
    values = [e["value"] for e in entries]
    assert values == options[1]["options"], values  # the server's order, every value under its real name
    assert values[:3] == ["auto_exact", "auto_fast", "comfy default"]
    runs = [v for v in values[3:] if route[v]["available"]]
    assert values[3:3 + len(runs)] == runs and "native" in runs and "flex" in runs
    assert not any(v.startswith("_") for v in values)
    menu = ui.js("""() => { const m = document.querySelector('.litecontextmenu'); const r = m.getBoundingClientRect();
        const items = [...m.children].map((e) => e.classList.contains('attention-dispatch-group')
            ? {group: e.textContent} : {value: typeof e.value === 'string' ? e.value : e.dataset.value});
        return {top: r.top, bottom: r.bottom, height: window.innerHeight, items}; }""")
    assert menu["top"] >= 0 and menu["bottom"] <= menu["height"], (menu["top"], menu["bottom"], shot)
    headings = [i["group"] for i in menu["items"] if "group" in i]
    assert headings[:2] == ["Automatic, or ComfyUI's own", "\u2713 Runs on this machine"], headings
    families = []
    for item in menu["items"]:  # each family heading comes right before its members, once
        if "group" in item and item["group"].startswith("\u2717 "):
            families.append(item["group"].split(":")[0][2:])
        elif "value" in item and not route.get(item["value"], {"available": True})["available"]:
            assert route[item["value"]]["family"] == families[-1], (item, families)
    assert len(families) == len(set(families)) and "flash2" in families, families
    assert any(h.startswith("\u2717 flash2: needs an NVIDIA CUDA GPU") for h in headings), headings
    ui.close_menus()


def _report(node_id, backend="flash", served="_native_flash", calls=8):
    """The attention_dispatch.report message of a Set Attention Backend node whose backend fell back."""
    reason = "flash: flash-attn is not installed: pip install 'flash-attn>=2.6.3' --no-build-isolation"
    rows = [{"site": site, "requested": backend, "served": served, "calls": calls // 2, "fell_back": True,
             "reasons": [reason]} for site in ("cross", "self")]
    return {"kind": "model", "node": str(node_id), "prompt_id": "browser-panel", "backend": backend,
            "policy": "fallback", "recorder": {"calls": calls, "rows": rows, "errors": []}}


def test_panel_never_covers_the_node_below(ui):
    """A Set Attention Backend with a node right under it: the warning and the "Last run" panel make it taller,
    and the node below moves down instead of being drawn over, its badge row too (drawn above its title: issue #41);
    the panel fits in its node (not cut off)."""
    if ui.mode == "nodes2":
        pytest.skip("Nodes 2.0 lays the nodes out in the page, not on the canvas: the panel test there is "
                    "test_dropdown_marks_what_cannot_run_here's and test_report_badge_after_a_prompt's")
    ui.add_node(pos=(220, 60))
    ui.js(f"""() => {{ const app = {APP}; const a = window.__adNode;
        const b = LiteGraph.createNode('SetAttentionBackend'); app.graph.add(b);
        b.widgets.find((w) => w.name === 'backend').value = 'flash';  // a node with a badge: "⚠ flash unavailable"
        b.pos = [a.pos[0] + 40, a.pos[1] + a.size[1] + LiteGraph.NODE_TITLE_HEIGHT + 10];
        window.__adBelow = b; app.canvas.setDirty(true, true); return b.id; }}""")
    ui.frames()
    start = ui.js("() => [...window.__adBelow.pos]")
    ui.js("() => { window.__adNode.widgets.find((w) => w.name === 'backend').value = 'flash'; }")
    ui.js(f"""(r) => {{ {API}.dispatchEvent(
        new CustomEvent('attention_dispatch.report', {{ detail: r }})); }}""", _report(ui.js("() => window.__adNode.id")))
    ui.frames(8)
    boxes = ui.js(f"""() => {{ const t = LiteGraph.NODE_TITLE_HEIGHT;
        const box = (n, above = 0) => ({{x: n.pos[0], y: n.pos[1] - t - above, w: n.size[0], h: n.size[1] + t + above}});
        const a = window.__adNode, st = a.attention_dispatch, b = window.__adBelow;
        const ctx = {APP}.canvas.ctx;  // the badge row above b's title: its tallest badge and the 2 px gaps
        const row = Math.max(0, ...b.badges.map((f) => (typeof f === 'function' ? f() : f))
            .filter((x) => x?.text).map((x) => (x.height ?? 20) + 4));
        const bottom = Math.max(...a.widgets.filter((w) => w.name !== 'attention_dispatch_panel')
            .map((w) => (w.y ?? 0) + (w.computedHeight ?? 24)));
        return {{a: box(a), b: box(b, row), row, panelTop: a.pos[1] + bottom, need: st.need,
                 blocks: (st.layout || []).map((b) => b.lines.join('\\n')), canvas: [...{APP}.canvas.ds.offset]}}; }}""")
    shot = _artifact(ui, f"panel-no-overlap-{ui.tag}.png")
    a, b = boxes["a"], boxes["b"]
    assert boxes["row"] >= 20, boxes  # the node below has its badge row
    assert any(block.startswith("Last run:") for block in boxes["blocks"]), boxes["blocks"]
    assert not any("Install:" in block for block in boxes["blocks"]), boxes["blocks"]  # none helps on a CPU
    overlap_x = min(a["x"] + a["w"], b["x"] + b["w"]) - max(a["x"], b["x"])
    overlap_y = min(a["y"] + a["h"], b["y"] + b["h"]) - max(a["y"], b["y"])
    assert overlap_x > 0 and overlap_y <= 0, (boxes, shot)  # across from each other, and not overlapping
    moved = ui.js("() => [...window.__adBelow.pos]")
    assert moved[0] == start[0] and moved[1] > start[1], (start, moved)  # the node below was moved down
    assert boxes["panelTop"] + boxes["need"] <= a["y"] + a["h"] + 1, (boxes, shot)  # the whole panel inside its node
    # the frontend's own resize to computeSize() (on a widget change, a reload) keeps room for the panel
    fits = ui.js("""() => { const a = window.__adNode; const before = a.size[1]; a.setSize(a.computeSize());
        const bottom = Math.max(...a.widgets.filter((w) => w.name !== 'attention_dispatch_panel')
            .map((w) => (w.y ?? 0) + (w.computedHeight ?? 24)));
        return [bottom + a.attention_dispatch.need, a.size[1], before]; }""")
    assert fits[0] <= fits[1] + 1, fits
    ui.js(f"() => {{ {APP}.graph.clear(); }}")


def test_settings_hide_unavailable_and_default_policy(ui):
    comfy = ui.comfy
    ui.add_node()
    ui.js("() => { window.__adNode.widgets.find((w) => w.name === 'backend').value = 'flash'; }")
    ui.set_setting("show", False)
    try:
        shown = [e["value"] for e in ui.open_dropdown()]
        route = {b["name"]: b for b in comfy.get("/attention_dispatch/backends")["backends"]}
        hidden = [n for n, b in route.items() if not b["available"] and n != "flash"]
        assert hidden and not set(hidden) & set(shown), shown
        assert "flash" in shown and "native" in shown and "auto_exact" in shown  # the current value stays listed
    finally:
        ui.set_setting("show", True)
    assert len(ui.open_dropdown()) == len(comfy.get("/object_info/SetAttentionBackend")["SetAttentionBackend"]
                                          ["input"]["required"]["backend"][1]["options"])
    ui.close_menus()

    ui.set_setting("policy", "strict")
    try:
        ui.add_node()
        assert ui.node_state()["policy"] == "strict"  # applied to a newly created node
    finally:
        ui.set_setting("policy", "fallback")
    ui.add_node()
    assert ui.node_state()["policy"] == "fallback"

    ui.add_node("SetClipAttentionBackend")  # the CLIP node's dropdown is marked the same way
    ui.js("() => { window.__adNode.widgets.find((w) => w.name === 'backend').value = 'flash'; }")
    st = ui.node_state()
    assert st["warning"]["text"].startswith("\u26a0 flash cannot run here")
    entries = {e["value"]: e for e in ui.open_dropdown()}
    assert entries["flash"]["text"].startswith("\u2717 flash") and entries["native"]["text"] == "\u2713 native"
    if ui.mode == "classic":
        assert st["display"] == "\u2717 flash"
        assert entries["flash"]["mark"] == "unavailable" and entries["native"]["mark"] == "available"
    ui.close_menus()


def test_report_badge_after_a_prompt(ui):
    comfy = ui.comfy
    ui.close_menus()
    prompt = wan_prompt(["flash", "native"])
    started = time.time()
    ui.js(f"""async (p) => {{ const app = {APP}; app.loadApiJson(p, 'attention_dispatch_browser_test');
        await app.queuePrompt(0, 1); }}""", prompt)
    ui.page.wait_for_function(f"""() => ['100', '110', '21'].every((id) =>
        {APP}.graph.getNodeById(Number(id))?.attention_dispatch?.summary)""", timeout=120000)
    run_seconds = time.time() - started
    fell = ui.node_state(f"{APP}.graph.getNodeById(100)")
    ok = ui.node_state(f"{APP}.graph.getNodeById(110)")

    # What ran, per node, from the attention_dispatch.report message of this prompt.
    reports = {r["node"]: r for r in comfy.get("/attention_dispatch/report")["reports"]}
    for node_id, st in (("100", fell), ("110", ok)):
        calls = reports[node_id]["recorder"]["calls"]
        assert st["summary"]["calls"] == calls and calls >= 8, (node_id, st["summary"], reports[node_id])
    assert fell["value"] == "flash" and "flash" not in fell["summary"]["served"]
    assert fell["summary"]["level"] == "warn"
    (fb,) = fell["summary"]["fallbacks"]
    assert fb["requested"] == "flash" and any("needs an NVIDIA CUDA GPU" in r for r in fb["reasons"])
    assert any(line.startswith("\u26a0 Fell back: flash \u2192 ") and "needs an NVIDIA CUDA GPU" in line
               for line in fell["summary"]["lines"]), fell["summary"]["lines"]
    # flash never ran: the badge says so (a fallback on every call leads it), the calls are in the panel
    assert fell["badge"].startswith("\u26a0 flash \u2192 ") and fell["badge"].endswith(" every call"), fell["badge"]
    assert any(line.startswith("\u26a0 Fell back: flash \u2192 ") and " (every call): " in line
               for line in fell["summary"]["lines"]), fell["summary"]["lines"]
    assert ok["summary"]["served"] == {"native": ok["summary"]["calls"]} and ok["summary"]["level"] == "ok"
    assert ok["badge"] == f"\u2713 native \u00b7 {ok['summary']['calls']} calls"
    # the panel folds the blocks by kind from the fields each row carries ("self 4 in 2 blocks"), not by their text
    (ran,) = [line for line in ok["summary"]["lines"] if line.startswith("Ran: native")]
    entries = ran.split("(", 1)[1].rstrip(")").split(", ")
    assert sorted(e.split(" ")[0] for e in entries) == ["cross", "self"], ran
    assert not any("#" in e.split(" at ")[0] for e in entries), ran  # no block left unfolded
    clip = ui.node_state(f"{APP}.graph.getNodeById(21)")  # from its `executed` text (no report message for TEs)
    assert clip["badge"].startswith("\u2713 native: patched 2"), clip

    # Lay the graph out with the grown nodes, then take the screenshot for the closing note.
    # (Nodes 2.0: the page lays the nodes out and LiteGraph's node.size lags it, so arrange() would overlap them.)
    ui.js(f"""(arrange) => {{ const app = {APP}; if (arrange) app.graph.arrange(80);
        app.canvas.ds.scale = 0.85; app.canvas.ds.offset = [40, 40]; app.canvas.setDirty(true, true); }}""",
          ui.mode == "classic")
    ui.page.wait_for_timeout(600)
    fell = ui.node_state(f"{APP}.graph.getNodeById(100)")
    assert any("Fell back: flash" in block for block in fell["panel"]), fell["panel"]  # drawn on the node
    if ui.mode == "nodes2":  # the badge the page shows is the latest run's, not the one chosen before it
        shown = {i: ui.js(f"() => document.querySelector(`[data-node-id='{i}']`)?.innerText ?? ''")
                 for i in (100, 110)}
        assert fell["badge"] in shown[100] and "flash unavailable" not in shown[100], shown
        assert ok["badge"] in shown[110], shown
        # the flash node's grown panel moved the node below it instead of sliding under it (the page's boxes)
        boxes = ui.js("""() => [100, 110].map((i) => {
            const r = document.querySelector(`[data-node-id='${i}']`).getBoundingClientRect();
            return [r.left, r.top, r.right, r.bottom]; })""")
        (l1, t1, r1, b1), (l2, t2, r2, b2) = boxes
        assert min(r1, r2) <= max(l1, l2) or b1 <= t2, boxes
        # and no node at all over another: a node the grown ones pushed pushes those below it in turn (the CLIP
        # node under 110 stayed under it when 110 had been moved and had grown before it made room: issue #48)
        every = ui.js("""() => [...document.querySelectorAll('[data-node-id]')]
            .filter((e) => !e.parentElement.closest('[data-node-id]')).map((e) => {
                const r = e.getBoundingClientRect(); return [e.dataset.nodeId, r.left, r.top, r.right, r.bottom]; })""")
        over = [(a[0], b[0]) for i, a in enumerate(every) for b in every[i + 1:]
                if min(a[3], b[3]) - max(a[1], b[1]) > 1 and min(a[4], b[4]) - max(a[2], b[2]) > 1]
        assert not over, (over, every)
        # at the zoom a user has (0.85 here), the panel is as wide as the node's widgets, tall enough for its text,
        # and ends above the node's badge row (1.53 stretched it over the badge: issue #48)
        for i, st in ((100, fell), (110, ok)):
            panel = ui.js(f"""(badge) => {{ const el = document.querySelector(`[data-node-id='{i}']`);
                const canvas = el.querySelector('canvas'), c = canvas.getBoundingClientRect();
                const pill = [...el.querySelectorAll('*')].find((e) => !e.children.length && e.textContent.trim() === badge);
                const b = pill.getBoundingClientRect(), box = canvas.parentElement.getBoundingClientRect();
                const n = {APP}.graph.getNodeById({i});
                return {{canvas: [c.left, c.top, c.right, c.bottom], box: [box.left, box.right], badgeTop: b.top,
                         need: n.attention_dispatch.need * {APP}.canvas.ds.scale}}; }}""", st["badge"])
            assert panel["canvas"][3] <= panel["badgeTop"] + 0.5, (i, panel)
            assert panel["canvas"][3] - panel["canvas"][1] >= panel["need"] - 0.5, (i, panel)
            assert abs(panel["canvas"][2] - panel["canvas"][0] - (panel["box"][1] - panel["box"][0])) <= 1, (i, panel)
    shot = ui.shots / "report.png"
    ui.page.screenshot(path=str(shot))
    _artifact(ui, f"badges-{ui.tag}.png")
    target = _screenshot_target()
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, target)
    print(f"\nscreenshot of the nodes with their badges: {target}")
    assert run_seconds < 100, run_seconds
    assert ui.backend_fetches == 1  # one fetch per page load, nothing polled since


WINDOW_SENTENCE = ("start_percent 0.8 is after end_percent 0.2 (the step window needs 0 <= start_percent <= "
                   "end_percent <= 1)")


def _refused_prompt(**inputs):
    """wan_prompt's Set Attention Backend chain alone (no other output node, so the refusal is the whole prompt's:
    HTTP 400), with `inputs` on node 100."""
    prompt = {k: v for k, v in wan_prompt(["native"]).items() if k not in ("20", "21", "22", "23")}
    prompt["100"]["inputs"].update(inputs)
    return prompt


def _idle(comfy, timeout=180):
    """Wait until ComfyUI runs and holds no prompt: a prompt an earlier test left running ends later, and the
    frontend clears the errors it shows when a run ends."""
    deadline = time.time() + timeout
    while True:
        queue = comfy.get("/queue")
        if not queue["queue_running"] and not queue["queue_pending"]:
            return
        assert time.time() < deadline, queue
        time.sleep(0.3)


def _queue_refused(ui, prompt):
    """Queue `prompt` from the page as the Run button does; the errors placed on node 100 ([input_name, details])
    and the text of what the frontend showed (1.53/1.58: the error overlay; 1.27: the error dialog)."""
    _idle(ui.comfy)
    ui.js(f"""async (p) => {{ const app = {APP}; await app.loadApiJson(p, 'attention_dispatch_refused');
        try {{ await app.queuePrompt(0, 1); }} catch {{ /* the frontend shows it */ }} }}""", prompt)
    ui.page.wait_for_function(f"() => !!{APP}.graph.getNodeById(100)?.attention_dispatch?.refused", timeout=60000)
    ui.page.wait_for_timeout(800)
    errors = ui.js(f"() => ({APP}.lastNodeErrors?.['100']?.errors ?? []).map((e) => [e.extra_info?.input_name, "
                   "e.details])")
    shown = ui.js("""() => [...document.querySelectorAll('[data-testid=error-overlay], .p-toast-message, .p-dialog')]
        .map((e) => e.innerText.replace(/\\s+/g, ' ').trim()).filter(Boolean)""")
    return errors, shown


def _aggregated_by_others(ui, shown) -> bool:
    """True when the frontend (1.53, 1.58) shows its aggregate "N errors found" because the page holds issues that
    are not the pack's (a missing model of another workflow on the page): it then quotes no error's sentence, and
    its details must list node 100's error once, on start_percent. False when it shows a lone error."""
    if not any(re.match(r"\d+ errors? found", text) for text in shown):
        return False
    ui.js("""() => [...document.querySelectorAll('[data-testid=error-overlay] button')]
        .forEach((b) => { if (b.innerText.includes('View details')) b.click(); })""")
    ui.page.wait_for_timeout(1000)
    details = ui.js("() => document.body.innerText.replace(/\\s+/g, ' ')")
    assert details.count("Set Attention Backend - start_percent") == 1, details[:3000]
    assert "Set Attention Backend - model" not in details, details[:3000]
    assert re.search(r"Missing (Models|Nodes|Inputs)", details), details[:3000]  # the others are not the pack's
    return True


def _close_dialogs(ui):
    ui.js("""() => document.querySelectorAll('.p-dialog-close-button, [data-testid=error-overlay-dismiss]')
        .forEach((b) => b.click())""")
    ui.page.wait_for_timeout(300)


def _marked_widgets(ui):
    """The widgets of node 100 a user sees marked: classic, the rings the extension drew (checked on the
    screenshot's pixels too); Nodes 2.0, the rows the frontend marks aria-invalid."""
    if ui.mode == "nodes2":
        return ui.js("""() => [...document.querySelectorAll("[data-node-id='100'] [aria-invalid=true]")]
            .map((e) => e.querySelector('[data-testid=widget-layout-field-label]')?.textContent.trim())""")
    rings = ui.js(f"""() => {{ const app = {APP}, n = app.graph.getNodeById(100), r = app.canvas.canvas.getBoundingClientRect();
        return (n.attention_dispatch.rings || []).map(({{name, ring}}) => {{
            const {{offset, scale}} = app.canvas.ds;  // the ring's left edge, halfway down, on the page
            return {{name, x: r.left + (n.pos[0] + ring[0] + offset[0]) * scale,
                     y: r.top + (n.pos[1] + ring[1] + ring[3] / 2 + offset[1]) * scale}}; }}); }}""")
    from PIL import Image
    shot = ui.shots / "rings.png"
    ui.page.screenshot(path=str(shot))
    with Image.open(shot) as image:
        rgb = image.convert("RGB")
        red = lambda x, y: any(rgb.getpixel((x + dx, y + dy))[0] > 200 and rgb.getpixel((x + dx, y + dy))[1] < 110
                               for dx in range(-3, 4) for dy in range(-3, 4))  # noqa: E731
        return [r["name"] for r in rings if red(round(r["x"]), round(r["y"]))]


def _show_node_100(ui):
    ui.js(f"""() => {{ const app = {APP}, n = app.graph.getNodeById(100);
        app.canvas.ds.scale = 1; app.canvas.ds.offset = [-n.pos[0] + 360, -n.pos[1] + 160];
        app.canvas.setDirty(true, true); }}""")
    ui.page.wait_for_timeout(800)


def test_refused_prompt_names_the_widget_at_fault(ui):
    """A prompt the pack refuses at queue time: one error per problem, on the widget it starts with, not on the
    `model` link ComfyUI names (web/node_errors.js); the frontend's message quotes the pack's sentence; the widget
    is marked (classic: the extension's ring; Nodes 2.0: the frontend's own); the node's panel says the sentences."""
    ui.close_menus()
    errors, shown = _queue_refused(ui, _refused_prompt(start_percent=0.8, end_percent=0.2))
    assert errors == [["start_percent", WINDOW_SENTENCE]], errors  # one problem, one error
    if not _aggregated_by_others(ui, shown):
        assert any(WINDOW_SENTENCE in text for text in shown), shown  # quoted, not "couldn't validate a connected node"
    assert not any("connected node" in text for text in shown), shown
    _close_dialogs(ui)
    _show_node_100(ui)
    assert _marked_widgets(ui) == ["start_percent"]
    slots = ui.js(f"() => {APP}.graph.getNodeById(100).inputs.filter((i) => i.hasErrors).map((i) => i.name)")
    assert slots == ["start_percent"], slots  # the frontend's own slot ring (classic: while hovered), not `model`
    panel = ui.node_state(f"{APP}.graph.getNodeById(100)")["panel"]
    assert panel and panel[0].replace("\n", " ") == f"\u2717 Refused at queue time: {WINDOW_SENTENCE}", panel
    _artifact(ui, f"refused-window-{ui.tag}.png")

    # Two problems (policy strict with a backend that cannot run here, and the window): two errors, one each.
    errors, shown = _queue_refused(ui, _refused_prompt(backend="flash", policy="strict", start_percent=0.8,
                                                       end_percent=0.2))
    placed = dict(errors)
    assert [name for name, _ in errors] == ["start_percent", "backend"], errors
    assert placed["backend"].startswith("attention backend 'flash' cannot run on this machine (policy strict)")
    assert placed["start_percent"] == WINDOW_SENTENCE
    _close_dialogs(ui)
    _show_node_100(ui)
    assert sorted(_marked_widgets(ui)) == ["backend", "start_percent"]
    panel = ui.node_state(f"{APP}.graph.getNodeById(100)")["panel"]
    assert panel and panel[0].startswith("\u2717 Refused at queue time:"), panel
    assert WINDOW_SENTENCE in panel[0].replace("\n", " ")
    assert "backend: attention backend 'flash' cannot run" in panel[0].replace("\n", " "), panel
    _artifact(ui, f"refused-{ui.tag}.png")
    # Queued again with the window fixed and the policy back to fallback: the refusal and the rings leave.
    ui.js(f"""async () => {{ const app = {APP}, n = app.graph.getNodeById(100);
        for (const [name, value] of [['policy', 'fallback'], ['start_percent', 0], ['end_percent', 1]]) {{
            n.widgets.find((w) => w.name === name).value = value; }}
        await app.queuePrompt(0, 1); }}""")
    ui.page.wait_for_function(f"() => {APP}.graph.getNodeById(100)?.attention_dispatch?.summary", timeout=120000)
    assert not ui.js(f"() => {APP}.graph.getNodeById(100).attention_dispatch.refused")
    ui.frames()
    assert _marked_widgets(ui) == []
    _idle(ui.comfy)


def test_the_badge_says_who_served_how_many(ui):
    """Two kernels served one node's calls (native in its step window 0.5..1, ComfyUI's own attention before it):
    the badge names each with its calls, never "native +1" (issue #48), on the canvas and in the page alike."""
    prompt = {k: v for k, v in wan_prompt(["native"]).items() if k not in ("20", "21", "22", "23")}
    prompt["100"]["inputs"].update(start_percent=0.5, end_percent=1.0)
    _idle(ui.comfy)
    ui.js(f"""async (p) => {{ const app = {APP}; await app.loadApiJson(p, 'attention_dispatch_two_kernels');
        await app.queuePrompt(0, 1); }}""", prompt)
    ui.page.wait_for_function(f"() => {APP}.graph.getNodeById(100)?.attention_dispatch?.summary", timeout=120000)
    st = ui.node_state(f"{APP}.graph.getNodeById(100)")
    served = sorted(st["summary"]["served"].items(), key=lambda kv: -kv[1])
    assert len(served) == 2 and served[0][0] in ("native", *[n for n, _ in served if n.startswith("comfy")]), served
    mark = "\u2713 " if st["summary"]["level"] == "ok" else "\u26a0 "  # outside its window: a fallback, warned
    assert st["badge"] == mark + " \u00b7 ".join(f"{name} {n}" for name, n in served), (st["badge"], served)
    _show_node_100(ui)
    if ui.mode == "nodes2":
        shown = ui.js("() => document.querySelector(\"[data-node-id='100']\").innerText")
        assert st["badge"] in shown, shown
    _artifact(ui, f"badge-two-kernels-{ui.tag}.png")
    _idle(ui.comfy)


def test_the_sampler_gets_its_height_back_after_tuning(ui):
    """auto_exact tunes in the sampler's first steps and shows its progress as text on the sampler: the frontend adds
    a widget for it that makes the node taller and, at the end of the run (1.58; 1.27 and 1.53 keep the text until
    the next run), removes it; the node is then as tall as before the run again (1.58 classic kept 45 px blank:
    issue #48)."""
    prompt = {k: v for k, v in wan_prompt(["auto_exact"]).items() if k not in ("20", "21", "22", "23")}
    # a latent no other test (or page on this server) has tuned: auto_exact tunes its shape here
    prompt["4"]["inputs"].update(width=random.randrange(48, 177, 16), height=random.randrange(48, 177, 16))
    _idle(ui.comfy)
    ui.js(f"async (p) => {{ await {APP}.loadApiJson(p, 'attention_dispatch_tuning'); }}", prompt)
    ui.frames()
    height = f"""() => {{ const n = {APP}.graph.getNodeById(101);
        const el = document.querySelector("[data-node-id='101']");
        return el ? el.getBoundingClientRect().height / {APP}.canvas.ds.scale : n.size[1]; }}"""
    before = ui.js(height)
    # the page watches the sampler every frame while it runs: the text widget comes and goes within the run
    ui.js(f"""() => {{ const watch = window.__samplerWatch = {{max: 0, seen: false, on: true}};
        const height = {height};
        const look = () => {{ if (!watch.on) return;
            watch.seen ||= {APP}.graph.getNodeById(101).widgets.some((w) => w.name === '$$node-text-preview');
            watch.max = Math.max(watch.max, height()); requestAnimationFrame(look); }};
        look(); }}""")
    ui.js(f"async () => {{ await {APP}.queuePrompt(0, 1); }}")
    ui.page.wait_for_function(f"() => {APP}.graph.getNodeById(100)?.attention_dispatch?.summary", timeout=120000)
    _idle(ui.comfy)
    gone = ui.js(f"""async () => {{ for (let i = 0; i < 100; i++) {{
            if (!{APP}.graph.getNodeById(101).widgets.some((w) => w.name === '$$node-text-preview')) return true;
            await new Promise((r) => setTimeout(r, 100)); }}
        return false; }}""")
    ui.page.wait_for_timeout(600)
    watch = ui.js("() => { window.__samplerWatch.on = false; return window.__samplerWatch; }")
    after = ui.js(height)
    _artifact(ui, f"sampler-after-tuning-{ui.tag}.png")
    assert watch["seen"] and watch["max"] > before + 10, (before, watch)  # the tuning's text grew the sampler
    if ui.frontend.version.startswith(("1.27.", "1.53.")):
        assert not gone and after >= watch["max"] - 1, (before, watch, after)  # the text stays, in the room it took
    else:
        assert gone and abs(after - before) <= 1, (gone, before, watch, after)


def test_the_panel_is_no_parameter(ui):
    """The panel under the widgets is the extension's own widget: the properties panel (1.53 on) lists the node's
    inputs, not it (issue #48: 1.53 listed "attention_dispatch_panel" with a menu and no control)."""
    toggle = "[aria-label='Toggle properties panel']"
    if not ui.js(f"() => !!document.querySelector({toggle!r})"):
        pytest.skip(f"frontend {ui.frontend.version} has no properties panel")
    node_id = ui.add_node()
    if ui.mode == "nodes2":  # the page's node: a click on its title selects it
        ui.page.locator(f"[data-node-id='{node_id}']").get_by_text("Set Attention Backend").first.click()
    else:
        ui.js(f"() => {{ {APP}.canvas.selectNode(window.__adNode); }}")
    ui.page.click(toggle)
    panel = "[data-testid=properties-panel]"
    try:
        ui.page.wait_for_function(f"() => document.querySelector({panel!r})?.innerText.includes('quality_guard')",
                                  timeout=10000)
        listed = ui.js(f"() => document.querySelector({panel!r}).innerText")
        _artifact(ui, f"parameters-{ui.tag}.png")
        assert "guard_every" in listed and "attention_dispatch_panel" not in listed, listed
    finally:
        ui.page.click(toggle)


def test_no_errors_from_the_extension(ui):
    ours = [e for e in ui.errors if "attention_dispatch" in e or "attention-dispatch" in e]
    warnings = [m for m in ui.logs if m.startswith(("warning:", "error:")) and "[attention dispatch]" in m]
    assert not ours and not warnings, (ours, warnings)
