"""The example workflows as a new user meets them: loaded in the real frontend, laid out without overlaps, run as
shipped in a real ComfyUI that has the model they name (a tiny random-weight SD1.5 checkpoint under that name).

Once per frontend and node mode (tests/web/conftest.py, as the browser tests): each example is loaded the way the
Templates browser loads it (app.loadGraphData of the shipped JSON) and checked for nodes drawn over each other, on
the canvas (classic) and in the page (Nodes 2.0, whose nodes are taller than the canvas's). On ComfyUI's own
frontend each is then turned into a prompt by the frontend itself (app.graphToPrompt, as Queue does) and queued; the
prompt must succeed; on the others the Set Attention Backend example runs (its badge after auto_exact). The
screenshots land in tests/web/artifacts/examples/ (git-ignored).

ATTN_DISPATCH_WRITE_EXAMPLES=1 lays the shipped examples out again from the nodes' real sizes on the newest frontend
in Nodes 2.0 (every node at least its computeSize() and its height in the page, columns by the graph's depth) and
writes them, with a thumbnail per example (the frontend's convention for a custom node pack's templates:
example_workflows/<name>.jpg: the example's own node, large, so the six differ), back into example_workflows/; and
the README's picture from the Set Attention Backend example's run on ComfyUI's own frontend.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import comfyui
from helpers.tiny_checkpoint import SOURCE as MAKE_CHECKPOINT

from .conftest import ARGS, CHROMIUM, frontend_params, playwright_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "example_workflows"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts" / "examples"
APP = "window.comfyAPI.app.app"
VIEW = (1600, 1000)
GAP_X, GAP_Y = 60, 50  # between columns; between nodes of a column (under the title bar)
THUMBNAIL_WIDTH = 480


def examples() -> list[Path]:
    return sorted(EXAMPLES.glob("*.json"))


def models_named() -> dict[str, set[str]]:
    """{folder: {file names}} every example names in its loaders' `properties.models` (the templates' convention)."""
    found: dict[str, set[str]] = {}
    for path in examples():
        for node in json.loads(path.read_text())["nodes"]:
            for model in node.get("properties", {}).get("models", []):
                found.setdefault(model["directory"], set()).add(model["name"])
    return found


MADE: set[str] = set()  # the servers (base folders) that have the tiny checkpoint


def _make_models(comfy) -> None:
    """The models the examples name, tiny, where ComfyUI looks for them (before the page reads the model lists)."""
    paths = [str(comfy.base / "models" / folder / name) for folder, names in models_named().items()
             for name in sorted(names)]
    assert paths, "no example names a model in properties.models"
    made = subprocess.run([comfyui.COMFYUI_PYTHON, "-c", MAKE_CHECKPOINT, *paths], cwd=comfyui.COMFYUI_PATH,
                          capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, f"making the tiny checkpoint failed:\n{made.stdout[-2000:]}\n{made.stderr[-4000:]}"
    MADE.add(str(comfy.base))


def _open(sync_api, comfy, profile, mode):
    """A page of `comfy` in `mode`, ready once the pack's and ComfyUI's node types are registered."""
    comfy_post(comfy, "/settings/Comfy.TutorialCompleted", True)  # no "Get Started" dialog over the canvas
    comfy_post(comfy, "/settings/Comfy.VueNodes.Enabled", mode == "nodes2")
    context = sync_api.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                          args=ARGS, viewport={"width": VIEW[0], "height": VIEW[1]})
    context.set_default_timeout(60000)
    p = context.pages[0] if context.pages else context.new_page()
    p.errors = []
    p.on("pageerror", lambda e: p.errors.append(f"{e}\n{getattr(e, 'stack', '')}"[:2000]))
    p.goto(comfy.url)
    # the node types registered too: a graph loaded before them has every node "missing"
    p.wait_for_function(f"() => {{ try {{ return !!{APP}?.graph && !!{APP}?.canvas && "
                        f"{APP}.extensions?.some((e) => e.name === 'attention_dispatch') && "
                        "!!window.LiteGraph?.registered_node_types?.SetAttentionBackend && "
                        "!!window.LiteGraph?.registered_node_types?.KSampler; } catch { return false; } }",
                        timeout=90000)  # comfyAPI is not there at first
    p.wait_for_timeout(1000)
    # the frontend's own start-up error (1.27.10: CORE_SETTINGS.forEach in GraphView) is not the examples'
    p.errors = [e for e in p.errors if "GraphView" not in e]
    return context, p


@functools.cache
def _newest_version() -> str:
    return frontend_params()[-1].values[0][0].version


@pytest.fixture(scope="module", params=frontend_params())
def page(request, frontend_servers):
    frontend, mode = request.param
    sync_api = playwright_for(frontend)
    comfy = frontend_servers(frontend)
    profile = tempfile.mkdtemp(prefix="attn-dispatch-examples-")
    try:
        with sync_api.sync_playwright() as pw:
            offered = None
            if str(comfy.base) not in MADE:  # a new user without the model: what loading an example offers
                context, p = _open(pw, comfy, profile, mode)
                try:
                    offered = load(p, json.loads((EXAMPLES / "Set Attention Backend.json").read_text()))
                finally:
                    context.close()
                _make_models(comfy)
            context, p = _open(pw, comfy, profile, mode)
            try:
                p.comfy, p.mode, p.frontend, p.offered = comfy, mode, frontend, offered
                p.tag = f"fe{frontend.version}-{mode}"
                p.bundled = frontend.static is None
                p.newest = frontend.version == _newest_version()
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                yield p
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def load(page, workflow: dict) -> list[str]:
    """Load `workflow` as the Templates browser does; returns the text of every dialog or alert it opened (a new
    user's "Some Nodes Are Missing", "Missing Models" or an invalid-workflow alert), then closes them."""
    page.evaluate(f"async (wf) => {{ await {APP}.loadGraphData(wf, true, true, null); }}", workflow)
    page.evaluate("async () => { for (let i = 0; i < 4; i++) await new Promise((r) => requestAnimationFrame(r)); }")
    page.wait_for_timeout(300)
    opened = page.evaluate("""() => [...document.querySelectorAll('.p-dialog, .p-toast-message, [data-testid=error-overlay]')]
        .map((e) => e.innerText.trim()).filter(Boolean)""")
    for _ in range(3):
        page.evaluate("""() => document.querySelectorAll(
            '.p-toast-message .p-toast-close-button, .p-dialog-close-button, [data-testid=error-overlay-dismiss]')
            .forEach((b) => b.click())""")
        page.wait_for_timeout(150)
    return opened


def boxes(page) -> list[dict]:
    """Every node as the user sees it: classic, its box on the canvas with the title bar and the smallest size that
    shows its widgets; Nodes 2.0, its element in the page (taller than the canvas's box: the page lays it out)."""
    if page.mode == "nodes2":
        return page.evaluate(f"""() => {APP}.graph._nodes.map((n) => {{
            const r = document.querySelector(`[data-node-id='${{n.id}}']`).getBoundingClientRect();
            return {{id: n.id, type: n.type, x: r.left, y: r.top, w: r.width, h: r.height}}; }})""")
    return page.evaluate(f"""() => {APP}.graph._nodes.map((n) => {{ const t = LiteGraph.NODE_TITLE_HEIGHT;
        const min = n.computeSize();
        return {{id: n.id, type: n.type, x: n.pos[0], y: n.pos[1] - t, w: n.size[0], h: n.size[1] + t,
                 minW: min[0], minH: min[1]}}; }})""")


def overlaps(nodes: list[dict]) -> list[tuple[str, str]]:
    found = []
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            if min(a["x"] + a["w"], b["x"] + b["w"]) > max(a["x"], b["x"]) and \
                    min(a["y"] + a["h"], b["y"] + b["h"]) > max(a["y"], b["y"]):
                found.append((a["type"], b["type"]))
    return found


def fit_view(page) -> None:
    """The whole graph in the window, the way extra.ds is shipped (so a screenshot shows what a user sees)."""
    page.evaluate(f"""() => {{ const app = {APP}; const t = LiteGraph.NODE_TITLE_HEIGHT;
        const ns = app.graph._nodes; const pad = 40, left = 90, top = 100;  // clear of the side bar and top bar
        const x0 = Math.min(...ns.map((n) => n.pos[0])), y0 = Math.min(...ns.map((n) => n.pos[1] - t));
        const x1 = Math.max(...ns.map((n) => n.pos[0] + n.size[0])), y1 = Math.max(...ns.map((n) => n.pos[1] + n.size[1]));
        const c = app.canvas.canvas.getBoundingClientRect();
        const scale = Math.min(1, (c.width - left - pad) / (x1 - x0), (c.height - top - pad) / (y1 - y0));
        app.canvas.ds.scale = scale; app.canvas.ds.offset = [left / scale - x0, top / scale - y0];
        app.canvas.setDirty(true, true); }}""")
    page.wait_for_timeout(400)


def lay_out(page) -> dict:
    """Lay the loaded graph out from its nodes' real sizes: each node at least its computeSize() (320 wide at
    least) and, in Nodes 2.0, its height in the page (taller: the page lays out its widgets), in columns by depth (a
    source sits just before its first consumer), stacked top down in the order the author gave; returns the
    serialized workflow."""
    return page.evaluate(f"""async ([gx, gy]) => {{ const app = {APP}; const g = app.graph;
        const t = LiteGraph.NODE_TITLE_HEIGHT;
        const frames = async (k) => {{ for (let i = 0; i < k; i++) await new Promise((r) => requestAnimationFrame(r)); }};
        const ns = [...g._nodes];
        // a Note as tall as its text (up to 7 px a character, 16 px a line: Nodes 2.0's box, the smaller), so it
        // reads without scrolling
        const noteHeight = (n) => {{ const perLine = Math.floor((360 - 60) / 7);
            const lines = String(n.widgets?.[0]?.value ?? '').split('\\n')
                .reduce((k, par) => k + Math.max(1, Math.ceil(par.length / perLine)), 0);
            return 60 + 16 * lines; }};
        const least = (n) => {{ const m = n.computeSize(); return [Math.max(320, m[0], n.type === 'Note' ? 360 : 0),
                                                                    Math.max(m[1], n.type === 'Note' ? noteHeight(n) : 0)]; }};
        for (const n of ns) n.setSize(least(n));
        app.canvas.setDirty(true, true);
        await frames(6);
        for (const n of ns) {{  // Nodes 2.0: as tall as the page draws it (its element holds the title bar)
            const el = document.querySelector(`[data-node-id='${{n.id}}']`);
            if (!el) continue;
            const r = el.getBoundingClientRect(), s = app.canvas.ds.scale;
            n.setSize([Math.max(n.size[0], Math.ceil(r.width / s)), Math.max(n.size[1], Math.ceil(r.height / s - t))]);
        }}
        const inputs = (n) => (n.inputs || []).filter((i) => i.link != null).map((i) => g.links[i.link].origin_id);
        const consumers = (n) => ns.filter((c) => inputs(c).includes(n.id));
        const depth = new Map();
        const d = (n) => {{ if (!depth.has(n.id)) depth.set(n.id, Math.max(0, ...inputs(n).map((o) => d(g.getNodeById(o)) + 1))); return depth.get(n.id); }};
        ns.forEach(d);
        for (const n of ns) {{ const cs = consumers(n);
            if (!inputs(n).length && cs.length) depth.set(n.id, Math.max(0, Math.min(...cs.map((c) => depth.get(c.id))) - 1)); }}
        for (const n of ns) if (n.type === 'Note') depth.set(n.id, 0);
        const cols = [...new Set([...depth.values()])].sort((a, b) => a - b);
        let x = 0;
        for (const c of cols) {{
            const col = ns.filter((n) => depth.get(n.id) === c)
                          .sort((a, b) => (a.type === 'Note') - (b.type === 'Note') || a.pos[1] - b.pos[1] || a.id - b.id);
            let y = t;
            for (const n of col) {{ n.pos = [x, y]; y += n.size[1] + t + gy; }}
            x += Math.max(...col.map((n) => n.size[0])) + gx;
        }}
        app.canvas.setDirty(true, true);
        return JSON.parse(JSON.stringify(g.serialize())); }}""", [GAP_X, GAP_Y])  # no undefined -> null


def test_a_missing_model_is_offered_for_download(page):
    """A new user without SD1.5 loads an example: the frontend names the file and offers it for download, from the
    loader's `properties.models` entry (name, url, directory: the templates' convention)."""
    if page.offered is None:
        pytest.skip("the tiny checkpoint was made for an earlier page of this ComfyUI: the model is there")
    assert any("v1-5-pruned-emaonly-fp16.safetensors" in text for text in page.offered), page.offered


def test_examples_lay_out_cleanly_in_the_frontend(page):
    """No node drawn over another (the title bar included; in Nodes 2.0 the page's boxes), none smaller than its
    widgets need, the view fitted; a screenshot of each, and its thumbnail where the frontend's Templates browser
    looks for it."""
    write = os.environ.get("ATTN_DISPATCH_WRITE_EXAMPLES") == "1" and page.newest and page.mode == "nodes2"
    assert len(examples()) == 6
    for path in examples():
        workflow = json.loads(path.read_text())
        opened = load(page, workflow)
        if write:
            laid = lay_out(page)
            fit_view(page)
            laid["extra"] = {**laid.get("extra", {}), "ds": page.evaluate(
                f"() => ({{scale: {APP}.canvas.ds.scale, offset: [...{APP}.canvas.ds.offset]}})")}
            path.write_text(json.dumps(laid, indent=2) + "\n")
            opened = load(page, json.loads(path.read_text()))
        assert not opened, (path.name, opened)
        fit_view(page)
        found = boxes(page)
        assert not overlaps(found), (path.name, page.tag, overlaps(found))
        small = [(n["type"], n["w"], n["h"] - 30, n["minW"], n["minH"]) for n in found if "minW" in n
                 and (n["w"] + 0.5 < n["minW"] or n["h"] - 30 + 0.5 < n["minH"])]
        assert not small, (path.name, small)
        page.screenshot(path=str(ARTIFACTS / f"{path.stem}-{page.tag}.png"))
        if write:
            _thumbnail(page, path)
        assert path.with_suffix(".jpg").is_file(), f"no thumbnail for {path.name}"
    assert not page.errors, page.errors


def _thumbnail(page, path: Path) -> None:
    """The Templates browser's picture of an example: the node it is named after (its title), large, with the
    nodes around it cut off at the edges, so the six thumbnails differ at a glance (a fitted view of the whole
    graph made six alike ones)."""
    from PIL import Image
    clip = page.evaluate(f"""(stem) => {{ const app = {APP}; const t = LiteGraph.NODE_TITLE_HEIGHT;
        const own = app.graph._nodes.filter((n) => n.title === stem);
        const x0 = Math.min(...own.map((n) => n.pos[0])), y0 = Math.min(...own.map((n) => n.pos[1] - t));
        const x1 = Math.max(...own.map((n) => n.pos[0] + n.size[0])), y1 = Math.max(...own.map((n) => n.pos[1] + n.size[1]));
        const c = app.canvas.canvas.getBoundingClientRect(), pad = 60, aspect = 1.6;
        let w = x1 - x0 + 2 * pad, h = y1 - y0 + 2 * pad;
        if (w / h < aspect) w = h * aspect; else h = w / aspect;
        const scale = Math.min(1.5, (c.width - 120) / w, (c.height - 200) / h);
        const cx = (x0 + x1) / 2, cy = (y0 + y1) / 2, left = 60, top = 100;
        app.canvas.ds.scale = scale;
        app.canvas.ds.offset = [(left - c.left) / scale + w / 2 - cx, (top - c.top) / scale + h / 2 - cy];
        app.canvas.setDirty(true, true);
        return {{x: left, y: top, width: w * scale, height: h * scale}}; }}""", path.stem)
    page.wait_for_timeout(600)
    shot = ARTIFACTS / f"thumbnail-{path.stem}.png"
    page.screenshot(path=str(shot), clip=clip)
    with Image.open(shot) as image:
        image = image.convert("RGB")
        height = round(image.height * THUMBNAIL_WIDTH / image.width)
        image.resize((THUMBNAIL_WIDTH, height), Image.LANCZOS).save(path.with_suffix(".jpg"), "JPEG", quality=82,
                                                                     optimize=True)


def test_the_templates_browser_lists_them_with_thumbnails(page):
    """ComfyUI's /workflow_templates names this pack's examples; each one and its thumbnail are served; the
    Templates browser titles them "Attention Dispatch" (locales/en/main.json), not the pack's folder name."""
    comfy = page.comfy
    listed = comfy.get("/workflow_templates")
    (module,) = [m for m, names in listed.items() if "Set Attention Backend" in names]
    assert sorted(listed[module]) == sorted(p.stem for p in examples())
    for name in listed[module]:
        for suffix in (".json", ".jpg"):
            url = f"{comfy.url}/api/workflow_templates/{module}/{urllib.request.quote(name + suffix)}"
            with urllib.request.urlopen(url, timeout=30) as r:
                assert r.status == 200 and len(r.read()) > 500, url
    page.evaluate(f"async () => {{ await {APP}.extensionManager.command.execute('Comfy.BrowseTemplates'); }}")
    try:
        page.wait_for_function("() => [...document.querySelectorAll('.p-dialog, [role=dialog]')]"
                               ".some((d) => d.innerText.includes('Attention Dispatch'))", timeout=30000)
        shown = page.evaluate("() => [...document.querySelectorAll('.p-dialog, [role=dialog]')]"
                              ".map((d) => d.innerText).join('\\n')")
        page.screenshot(path=str(ARTIFACTS / f"templates-{page.tag}.png"))
        assert module not in shown.splitlines(), shown[:2000]  # the folder's name is no title
    finally:
        page.keyboard.press("Escape")
        page.wait_for_timeout(300)


def _queue(page, prompt: dict) -> tuple[int, dict]:
    """Queue `prompt` from the page, as the Queue button does (the page's client id, so the pack's reports reach
    the nodes); (HTTP status, body)."""
    return page.evaluate(f"""async (p) => {{ const r = await window.comfyAPI.api.api.fetchApi('/prompt', {{
        method: 'POST', headers: {{'Content-Type': 'application/json'}},
        body: JSON.stringify({{prompt: p, client_id: window.comfyAPI.api.api.clientId}}) }});
        return [r.status, await r.json()]; }}""", prompt)


def test_examples_are_accepted_and_run(page):
    """Each example, turned into a prompt by the frontend as the Queue button does, is accepted by the real ComfyUI
    exactly as shipped (every input validated at queue time: the model it names is there, no mode that needs
    torchrun), then runs to a saved image. The run itself is shortened (1 step at 64x64; the shipped 20 steps at
    512x512 take minutes per example on a CPU) unless ATTN_DISPATCH_EXAMPLES_FULL=1: backend, policy, mode and
    every other input as shipped. All six on ComfyUI's own frontend; on the others the Set Attention Backend example,
    whose badge after auto_exact says who served how many calls (issue #48: "native +1 · 8 calls" for native 4 and
    _native_math 4). The Set Attention Backend example's screenshot after its run on ComfyUI's own frontend is the
    README's."""
    comfy = page.comfy
    full = os.environ.get("ATTN_DISPATCH_EXAMPLES_FULL") == "1"
    for path in examples() if page.bundled else [EXAMPLES / "Set Attention Backend.json"]:
        load(page, json.loads(path.read_text()))
        shipped = page.evaluate(f"async () => (await {APP}.graphToPrompt()).output")
        status, body = _queue(page, shipped)
        assert status == 200 and not body.get("node_errors"), (path.name, body)
        if full:
            prompt_id = body["prompt_id"]
        else:  # accepted as shipped; stop it and run the shortened copy
            comfy_post(comfy, "/queue", {"delete": [body["prompt_id"]]})
            comfy_post(comfy, "/interrupt", {})
            comfy.wait(body["prompt_id"], timeout=600) if _queued_or_running(comfy, body["prompt_id"]) else None
            # shortened on the canvas too, so the screenshots after the run show what ran
            short = page.evaluate(f"""async () => {{ const app = {APP};
                const set = (type, name, value) => app.graph._nodes.filter((n) => n.type === type).forEach((n) => {{
                    n.widgets.find((w) => w.name === name).value = value; }});
                set('KSampler', 'steps', 1); set('EmptyLatentImage', 'width', 64); set('EmptyLatentImage', 'height', 64);
                // a seed of its own: another page's identical prompt would come from ComfyUI's cache, without a report
                set('KSampler', 'seed', Math.floor(Math.random() * 2 ** 31));
                return (await app.graphToPrompt()).output; }}""")
            status, body = _queue(page, short)
            assert status == 200, (path.name, body)
            prompt_id = body["prompt_id"]
        started = time.time()
        entry = comfy.wait(prompt_id, timeout=3000 if full else 600)
        assert entry["status"].get("status_str") == "success", (path.name, entry["status"], comfy.tail())
        images = [i for out in entry["outputs"].values() for i in out.get("images", [])]
        assert images, (path.name, entry["outputs"])
        print(f"\n{path.name}: ran in {time.time() - started:.1f} s ({'as shipped' if full else 'shortened'})")
        page.wait_for_timeout(800)  # the pack's report reaches the nodes
        fit_view(page)
        page.screenshot(path=str(ARTIFACTS / f"{path.stem} - after a run - {page.tag}.png"))
        if path.stem == "Set Attention Backend":
            _badge_says_who_served(page)
            if page.bundled:
                _readme_picture(page)


def _badge_says_who_served(page) -> None:
    """The Set Attention Backend node's badge after its run: one kernel with the calls, two each with its calls, more
    as a count of kernels; never "native +1"; the same text where the user sees it (Nodes 2.0: the page)."""
    st = page.evaluate(f"""() => {{ const n = {APP}.graph._nodes.find((n) => n.type === 'SetAttentionBackend');
        const st = n.attention_dispatch;
        const el = document.querySelector(`[data-node-id='${{n.id}}']`);
        return {{badge: st.badgeText, served: st.summary?.served ?? {{}}, calls: st.summary?.calls ?? 0,
                 shown: el ? el.innerText : null, level: st.badgeLevel}}; }}""")
    served = sorted(st["served"].items(), key=lambda kv: -kv[1])
    assert served and sum(n for _, n in served) == st["calls"], st
    mark = "\u2713 " if st["level"] == "ok" else "\u26a0 "
    if len(served) == 1:
        expected = f"{served[0][0]} \u00b7 {served[0][1]} call{'s' if served[0][1] != 1 else ''}"
    elif len(served) == 2:
        expected = " \u00b7 ".join(f"{name} {n}" for name, n in served)
    else:
        expected = f"{len(served)} kernels \u00b7 {st['calls']} calls"
    assert st["badge"].startswith(mark + expected), (st, expected)
    assert "+1" not in st["badge"], st
    if st["shown"] is not None:
        assert st["badge"] in st["shown"], st
    page.screenshot(path=str(ARTIFACTS / f"badge-{page.tag}.png"))


README_PICTURE = ROOT / "docs" / "2026-12-06-web-extension.png"


def _readme_picture(page) -> None:
    """The README's picture: this example after its run, at full scale, from the loader to the sampler (the node's
    badge and its "Last run" panel); written into docs/ with ATTN_DISPATCH_WRITE_EXAMPLES=1."""
    clip = page.evaluate(f"""() => {{ const app = {APP}; const t = LiteGraph.NODE_TITLE_HEIGHT;
        const ns = app.graph._nodes.filter((n) => ['CheckpointLoaderSimple', 'SetAttentionBackend', 'CLIPTextEncode',
                                                   'EmptyLatentImage', 'KSampler', 'Note'].includes(n.type));
        const x0 = Math.min(...ns.map((n) => n.pos[0])), y0 = Math.min(...ns.map((n) => n.pos[1] - t));
        const x1 = Math.max(...ns.map((n) => n.pos[0] + n.size[0])), y1 = Math.max(...ns.map((n) => n.pos[1] + n.size[1]));
        const c = app.canvas.canvas.getBoundingClientRect();
        const scale = Math.min(1, (c.width - 40) / (x1 - x0), (c.height - 40) / (y1 - y0));
        app.canvas.ds.scale = scale; app.canvas.ds.offset = [20 / scale - x0, 20 / scale - y0];
        app.canvas.setDirty(true, true);
        return {{x: c.left, y: c.top, width: Math.min(c.width, (x1 - x0) * scale + 40),
                 height: Math.min(c.height, (y1 - y0) * scale + 40)}}; }}""")
    page.wait_for_timeout(500)
    shot = ARTIFACTS / "readme.png"
    page.screenshot(path=str(shot), clip=clip)
    if os.environ.get("ATTN_DISPATCH_WRITE_EXAMPLES") == "1":
        shutil.copyfile(shot, README_PICTURE)


def comfy_post(comfy, route: str, data) -> None:
    req = urllib.request.Request(comfy.url + route, data=json.dumps(data).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def _queued_or_running(comfy, prompt_id: str) -> bool:
    queue = comfy.get("/queue")
    return any(item[1] == prompt_id for item in queue["queue_running"] + queue["queue_pending"]) or \
        prompt_id in comfy.get(f"/history/{prompt_id}")
