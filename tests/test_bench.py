"""`python -m dispatcher bench` and `bench/bench_comfyui.py` end to end on small CPU shapes, the reference paths,
the chart, and zero-copy dispatch."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dispatcher
from dispatcher import auto as tuner
from dispatcher import dispatch_attention_fn
from dispatcher.tools import bench
from dispatcher.__main__ import main as cli

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import comfyui_attention  # noqa: E402  (bench/: the ComfyUI reference paths live outside the package)
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(autouse=True)
def _no_disk_tuning(tmp_path, monkeypatch):
    monkeypatch.setenv(tuner.ENV_CACHE, str(tmp_path / "tune.json"))


def test_bench_command_end_to_end_on_small_cpu_shapes(tmp_path):
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    cmd = [sys.executable, "bench/bench_comfyui.py", "--small", "--json", str(out_json)]
    if HAVE_MPL:
        cmd += ["--png", str(out_png)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out_json.read_text())
    assert data["meta"]["small"] and data["meta"]["torch"] == torch.__version__
    assert [s["name"] for s in data["shapes"]] == [m.name for m in bench.MODELS]
    rows = data["rows"]
    timed = [r for r in rows if r["ms"] is not None]
    assert {"native", "_native_math", "auto", "comfy default"} <= {r["backend"] for r in timed}
    for r in timed:
        assert r["ms"] > 0 and r["tflops"] > 0 and r["rel_error"] < 1e-4, r
        assert r["ratio_to_best"] is not None and r["ratio_to_best"] > 0, r
    for r in (r for r in timed if r["backend"] not in ("auto", "comfy default")):
        assert r["valid"] and r["direct_ms"] > 0 and r["dispatch_vs_direct"] > 0 and r["ratio_to_best"] <= 1.0
    for shape in data["shapes"]:
        assert shape["best"] and shape["auto"]["chosen"] and shape["auto"]["auto_vs_oracle"] > 0
        comfy = shape["references"]["paths"]["comfy default"]
        assert comfy["ms"] > 0 and comfy["auto_vs"] > 0 and comfy["native_vs"] > 0 and comfy["rel_error"] < 1e-4
        assert shape["flops"] == 4 * shape["B"] * shape["H"] * shape["Lq"] * shape["Lk"] * shape["D"]
    assert data["overhead"]["dispatch_us"] > 0 and data["overhead"]["direct_us"] > 0
    assert data["tuning"]["signatures"]  # what auto measured, rejected and chose
    assert "TFLOP/s" in run.stdout and "auto_exact ->" in run.stdout and "comfy default (reference path" in run.stdout
    if HAVE_MPL:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_interleaved_samples_change_their_order():
    """No function always leads a round or follows the same one (a sample runs partly at the clocks the one
    before it left)."""
    ran = []
    fns = [lambda name=name: ran.append(name) for name in "abc"]
    medians = bench.time_interleaved(fns, torch.device("cpu"), warmup=0, runs=3, target_s=1e-9)
    assert "".join(ran) == "abc" + "abc" "cba" "bca"  # one call each to size its samples, then three rounds
    assert len(medians) == 3 and all(m >= 0 for m in medians)


def test_bench_your_own_shape_and_backend_list(tmp_path, capsys):
    out = tmp_path / "mine.json"
    code = cli(["bench", "--shape", "1,2,40,16,24", "--backends", "native,_native_math,no_such", "--no-overhead",
                "--runs", "2", "--json", str(out), "--quiet"])
    assert code == 0
    data = json.loads(out.read_text())
    (shape,) = data["shapes"]
    assert (shape["Lq"], shape["Lk"], shape["D"]) == (40, 24, 16)  # not shrunk: lengths under --small's floor
    assert [r["backend"] for r in shape["rows"]] == ["native", "_native_math"]
    assert "no_such" in shape["skipped"] and data["overhead"] is None
    assert "your shape" in capsys.readouterr().out


def test_bench_rejects_a_bad_shape_and_dtype(capsys):
    with pytest.raises(SystemExit):
        cli(["bench", "--shape", "1,2,3"])
    assert cli(["bench", "--dtype", "int8", "--no-overhead"]) == 2


def test_small_lengths():
    assert [bench.small_length(m.len_q) for m in bench.MODELS] == [16, 16, 16, 16, 16, 24, 24, 128, 128, 120]
    assert bench.smaller(bench.MODELS[0]).head_dim == 40


def test_comfy_reference_path_matches_exact_and_the_pack_path():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 3 * 16, generator=g) for n in (20, 12, 12))
    ref = F.scaled_dot_product_attention(*(t.view(2, -1, 3, 16).transpose(1, 2) for t in (q, k, v)))
    comfy = comfyui_attention.comfy_attention_pytorch(q, k, v, 3)
    assert comfy.shape == (2, 20, 48)
    torch.testing.assert_close(comfy, ref.transpose(1, 2).reshape(2, 20, 48))
    torch.testing.assert_close(bench.pack_attention(q, k, v, 3, "native"), comfy)
    mask = torch.zeros(20, 12)
    mask[:, -4:] = float("-inf")
    ref_masked = F.scaled_dot_product_attention(*(t.view(2, -1, 3, 16).transpose(1, 2) for t in (q, k, v)),
                                                attn_mask=mask)
    torch.testing.assert_close(comfyui_attention.comfy_attention_pytorch(q, k, v, 3, mask=mask),
                               ref_masked.transpose(1, 2).reshape(2, 20, 48))


@pytest.mark.parametrize("name", ["native", "_native_flash", "_native_math", "flex"])
def test_direct_calls_compute_what_the_dispatcher_does(name):
    q, k, v = (torch.randn(1, 24, 2, 16) for _ in range(3))
    direct = bench.direct_call(name, q, k, v)()
    if registry_layout(name) == "BHSD":
        direct = direct.transpose(1, 2)
    torch.testing.assert_close(direct, dispatch_attention_fn(q, k, v, backend=name), atol=1e-5, rtol=1e-4)


def registry_layout(name):
    return dispatcher.get_backend_spec(name).layout


def test_exact_reference_on_sampled_rows():
    q, k, v = (torch.randn(2, n, 4, 8) for n in (50, 30, 30))
    rows = tuner.sample_rows(50, 7)
    assert rows[0] == 0 and rows[-1] == 49 and len(rows) == 7
    out, lse = tuner.exact_attention(q, k, v, rows=rows, max_bytes=1)  # one head at a time
    full = F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v)))
    torch.testing.assert_close(out, full[:, :, rows])
    assert lse.shape == (2, 4, 7)


def test_overhead_measurement_runs():
    with tuner.using(tuner.Tuner(cache_path=None, backends=("native",))):
        result = bench.measure_overhead(calls=50, repeats=1)
    assert result["direct_us"] > 0 and result["dispatch_us"] > 0 and result["auto_us"] > 0


# ----------------------------------------------------------------------------------------------- zero copy

@pytest.mark.parametrize("kernel_layout", ["BSHD", "BHSD"])
@pytest.mark.parametrize("through", ["backend", "auto"])
def test_a_flat_input_reaches_the_kernel_as_a_view(kernel_layout, through, tmp_path):
    """(B, L, H·D) viewed as (B, L, H, D): the kernel gets those very bytes (a transpose at most), no copy."""
    seen = {}

    def kernel(q, k, v, **_):
        seen["in"] = [(t.data_ptr(), t.stride(), tuple(t.shape)) for t in (q, k, v)]
        bhsd = [t if kernel_layout == "BHSD" else t.transpose(1, 2) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*bhsd)
        out = out if kernel_layout == "BHSD" else out.transpose(1, 2)
        seen["out"] = out.data_ptr()
        return out

    name = f"recording_{kernel_layout.lower()}"
    dispatcher.register_backend(name, kernel, layout=kernel_layout, devices=("cpu",))
    b, lq, lk, h, d = 2, 32, 24, 4, 16
    x = torch.randn(b, lq, h * d)
    kv = torch.randn(b, lk, 2 * h * d)  # a fused kv projection: k and v are strided views into it
    q = x.view(b, lq, h, d)
    k, v = kv.view(b, lk, 2, h, d).unbind(2)
    with tuner.using(tuner.Tuner(cache_path=tmp_path / "t.json", backends=(name,))):
        out = dispatch_attention_fn(q, k, v, backend=name if through == "backend" else "auto")
    expected = [(t.data_ptr(), (t if kernel_layout == "BSHD" else t.transpose(1, 2)).stride(),
                 tuple((t if kernel_layout == "BSHD" else t.transpose(1, 2)).shape)) for t in (q, k, v)]
    assert seen["in"] == expected
    assert q.data_ptr() == x.data_ptr() and k.data_ptr() == kv.data_ptr()
    assert out.data_ptr() == seen["out"] and out.shape == (b, lq, h, d)  # the output is not copied either
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    torch.testing.assert_close(out, ref)


def test_the_package_bench_knows_no_comfyui():
    """Issue #13: ComfyUI knowledge lives in bench/, never in the framework-agnostic package."""
    source = (ROOT / "dispatcher" / "tools" / "bench.py").read_text()
    for word in ("import comfy", "from comfy", "COMFYUI_PATH", "--comfyui", "attention_pytorch("):
        assert word not in source
    parser = __import__("argparse").ArgumentParser()
    bench.add_arguments(parser)
    assert not any("comfy" in a.dest for a in parser._actions)


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed")
def test_chart_has_one_panel_per_ratio_with_labelled_reference_lines(tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = []
    for name, dvd, avo in (("a", 0.99, 2.6), ("b", 1.01, 0.97)):
        shapes.append({"name": name, "B": 1, "H": 2, "Lq": 16, "D": 8, "best": "native",
                       "rows": [{"shape": name, "backend": "native", "ms": 1.0, "tflops": 1.0, "rel_error": 0.0,
                                 "valid": True, "ratio_to_best": 1.0, "dispatch_vs_direct": dvd}],
                       "auto": {"ms": 1.0, "tflops": 1.0, "rel_error": 0.0, "chosen": "native", "auto_vs_oracle": avo},
                       "references": {"pack_native_ms": 1.0, "pack_auto_ms": 1.0,
                                      "paths": {"ref": {"ms": 3.2, "tflops": 0.3, "rel_error": 0.0, "native_vs": 3.2,
                                                        "auto_vs": 3.1}}}})
    data = {"meta": {"device_name": "cpu", "dtype": "float32", "torch": "x", "small": True}, "shapes": shapes}
    saved = {}
    real_savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (saved.setdefault("fig", fig), real_savefig(fig, *a, **k)))
    bench.write_png(data, str(tmp_path / "c.png"))
    axes = saved["fig"].axes
    assert len(axes) == 4  # TFLOP/s, dispatcher/direct, auto/oracle, pack/reference: one ratio kind per panel
    for ax in axes[1:]:
        lines = [l for l in ax.get_lines() if l.get_linestyle() == "--"]
        assert len(lines) == 1 and lines[0].get_label().startswith("1.0 = ")  # labelled reference line
        tallest = max(p.get_height() for p in ax.patches)
        assert ax.get_ylim()[1] > tallest  # never clipped (the old chart stopped at 1.5)
    plt.close("all")


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed")
@pytest.mark.parametrize("run", [2, 3, 5])
def test_the_shipped_charts_never_clip_a_bar_and_use_the_current_names(run):
    """The charts in bench/results clipped their bars at 1.5, called auto_exact "auto" and were linked nowhere:
    drawn again from their JSON by `chart`, every bar fits its panel, the legends sit beside the panels (over no
    bar), auto_exact has its current name, and docs/performance.md shows the PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    name = f"2026-12-02-h200-bench-run{run}"
    data = json.loads((ROOT / "bench" / "results" / f"{name}.json").read_text())
    fig = bench.chart(data)
    fig.canvas.draw()
    labels = []
    for ax in fig.axes:
        tallest = max((p.get_height() for p in ax.patches if hasattr(p, "get_height")), default=0)
        assert ax.get_ylim()[1] >= tallest, (ax.get_title(), ax.get_ylim(), tallest)
        legend = ax.get_legend()
        labels += [t.get_text().strip() for t in legend.get_texts()]
        legend_box = legend.get_window_extent().transformed(ax.transAxes.inverted())
        assert legend_box.x0 >= 1.0, ax.get_title()  # beside the panel, never over its bars
    assert "auto_exact" in labels and "auto" not in labels, labels
    assert all("auto " not in ax.get_title() and not ax.get_title().startswith("auto ") for ax in fig.axes)
    plt.close(fig)
    assert f"../bench/results/{name}.png" in (ROOT / "docs" / "performance.md").read_text()


def test_side_by_side_reports_errors_picks_and_what_cannot_run(tmp_path):
    """bench/side_by_side.py on a small CPU shape with local (video-like) inputs: each backend's time and error
    against float64, what each auto served, and the GPU kernels listed as skipped with their reasons."""
    import side_by_side
    out = tmp_path / "sbs.json"
    assert side_by_side.main(["--shape", "1,2,512,64", "--inputs", "local", "--runs", "2", "--json", str(out),
                              "--backends", "native,sol_attn,comfy_kitchen_int8,flash_4,flash_3_fp8,auto_exact,"
                              "auto_fast"]) == 0
    result = json.loads(out.read_text())
    assert set(result["ms"]) == {"native", "auto_exact", "auto_fast"} and result["grid"] == [1, 16, 32]
    assert all(e < 1e-5 for e in result["rel_error_vs_float64"].values())  # exact kernels on the CPU
    assert result["served"]["auto_exact"] in dispatcher.backend_names()
    flops = 4 * 2 * 512 * 512 * 64
    for name, ms in result["ms"].items():  # TFLOP/s-equivalent: exact attention's flops over the time
        assert result["tflops_equivalent"][name] == round(flops / (ms * 1e-3) / 1e12, 1)
    for name in ("sol_attn", "comfy_kitchen_int8", "flash_4", "flash_3_fp8"):
        assert any("needs an NVIDIA CUDA GPU" in r for r in result["skipped"][name]), result["skipped"]


def test_side_by_side_outlier_inputs_leave_exact_attention_unchanged():
    """--inputs outlier: a key channel of size 100 the queries ignore, so exact attention is that of the inputs
    without it (what the bench measures quantised kernels against)."""
    import side_by_side
    q, k, v = side_by_side.inputs("outlier", 1, 2, 256, 32, torch.device("cpu"), torch.float32)
    assert float(k[..., 0].abs().min()) == 100 and float(q[..., 0].abs().max()) == 0
    clean = k.clone()
    clean[..., 0] = 0
    torch.testing.assert_close(bench_sdpa(q, k, v), bench_sdpa(q, clean, v))


def bench_sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                            v.transpose(1, 2)).transpose(1, 2)


def test_local_video_inputs_have_the_locality_block_sparse_routing_needs():
    """Most of each 64-token query block's attention falls in a few key blocks (what sol_attn's tau 1.0 keeps
    exact, ~16%); on noise it does not."""
    def mass_in_top_blocks(q, k):
        q, k = q.transpose(1, 2).double(), k.transpose(1, 2).double()
        p = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).softmax(-1)
        n = q.shape[2] // 64
        per_block = p.reshape(*p.shape[:2], n, 64, n, 64).sum(-1).mean(3)
        return float(per_block.sort(-1, descending=True).values[..., :max(1, int(0.16 * n))].sum(-1).mean())

    q, k, _ = bench.local_video_qkv(1, 2, 4, 16, 32, 128, device="cpu", dtype=torch.float32)
    assert mass_in_top_blocks(q, k) > 0.98
    noise = torch.randn(2, 1, 2048, 2, 128, generator=torch.Generator().manual_seed(0))
    assert mass_in_top_blocks(noise[0], noise[1]) < 0.5
    assert bench.video_grid(32760) == (21, 30, 52) and bench.video_grid(4608) == (1, 64, 72)


@pytest.mark.parametrize("bad_from_step, every, most", [(0, 0, 0), (2, 3, 2)])
def test_guard_bench_one_bad_block_of_many_counts_spoiled_calls(tmp_path, bad_from_step, every, most):
    """bench/guard_cost.py --scenario one-bad-block on the CPU with its simulated int8 kernel: one bad block of
    six sharing a signature. Bad from the start: caught at its first call, 0 spoiled calls, the others keep the
    kernel. Bad from step 2 with every = 3: at most 2 spoiled calls (the rotation bound) before the check."""
    out = tmp_path / "bad.json"
    cmd = [sys.executable, "bench/guard_cost.py", "--scenario", "one-bad-block", "--device", "cpu", "--kernel",
           "int8-sim", "--tokens", "256", "--heads", "2", "--head-dim", "32", "--blocks", "6", "--bad-block", "2",
           "--steps", "8", "--bad-from-step", str(bad_from_step), "--every", str(every), "--json", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["spoiled_calls"] <= most and (most == 0 or result["spoiled_calls"] >= 1), result["spoiled"]
    assert {f["site"] for f in result["guard_failures"]} == {"self #2"}
    assert result["served"] == {"self #2": "native"} if bad_from_step == 0 else "self #2" in result["served"]
    assert result["served_calls"]["bench_int8_sim"] >= 5 * 8  # the five good blocks keep it


def test_the_step_table_rates_the_autos_against_the_best_pinned_kernel_and_fills_the_readme_slot(tmp_path):
    import comfy_model_step
    import step_table
    measured = [{"attention": "comfy default", "ms": 12.0}, {"attention": "native", "ms": 10.0, "served": ["native"]},
                {"attention": "_native_flash", "ms": 8.0, "served": ["_native_flash"]},
                {"attention": "auto_exact", "ms": 8.08, "served": ["_native_flash"]}]
    rows = comfy_model_step.table_rows("sdxl", "eager", measured, ["native", "_native_flash"])
    by = {r["attention"]: r for r in rows}
    assert by["auto_exact"]["vs_best_pinned"] == pytest.approx(8.0 / 8.08)
    assert by["native"]["vs_comfy"] == pytest.approx(1.2) and "vs_best_pinned" not in by["native"]
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{step_table.START}\nnot measured yet\n{step_table.END}\n## More\n")
    data = {"table": rows, "device": "NVIDIA H200", "torch": "2.11", "runs": 20}
    step_table.fill_readme(readme, data, "bench/results/x-step-table.png", "x.json")
    text = readme.read_text()
    assert "not measured yet" not in text and "![Step time per model and attention](bench/results/x-step-table.png)" in text
    assert "| sdxl | eager | auto_exact | 8.08 | 1.485 | 0.990 | _native_flash |" in text and text.endswith("## More\n")
    if HAVE_MPL:
        step_table.write_png(data, str(tmp_path / "chart.png"))
        assert (tmp_path / "chart.png").stat().st_size > 1000


@pytest.mark.parametrize("every", [3, 0])
def test_guard_bench_the_issues_scenario_on_one_shared_site(tmp_path, every):
    """The issue's run on the CPU (fewer heads): 30 blocks behind one call site (a library caller without call_site),
    `auto_fast` serving the simulated int8 kernel, block 7 bad from step 5 of 20. With every = 3 a fixed period
    never checked block 7 (15 spoiled); the shared schedule catches it within its bound, block 7 only, and the
    site is demoted whole. At the default the interval is measured on this machine (how far apart the checks fall
    then depends on what a check costs here against a call: the JSON says from which times)."""
    from dispatcher import guard_schedule, guard_sizing
    from dispatcher.report import rotation_text
    out = tmp_path / "shared.json"
    cmd = [sys.executable, "bench/guard_cost.py", "--scenario", "one-bad-block", "--device", "cpu", "--kernel",
           "int8-sim", "--backend", "auto_fast", "--tokens", "256", "--heads", "2", "--head-dim", "32", "--blocks",
           "30", "--bad-block", "7", "--steps", "20", "--bad-from-step", "5", "--shared-site", "--every", str(every),
           "--json", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    per_block = result["spoiled_per_block"]
    assert len(per_block) == 30 and sum(per_block) == per_block[7] == result["spoiled_calls"]
    assert sum(result["checks_per_block"]) == result["guard_checks"]
    assert result["rotation"] == rotation_text(result["rotation_bound"])  # "... within N of its calls"
    if every:
        bound = guard_schedule.shared(every).bound
        assert result["interval"] == every and result["interval_source"] == "given" and result["sizing"] == []
        assert [f["site"] for f in result["guard_failures"]] == ["attention"]  # caught; the site demoted whole
        assert per_block[7] <= bound - 1 and result["checks_per_block"][7] >= 1
        return
    (sized,) = result["sizing"]
    assert result["interval_source"] == "measured" and result["interval"] == sized["interval"] >= 1
    # at most what the times give (a sizing at most doubles the interval in force; the JSON rounds the times)
    assert sized["interval"] <= guard_sizing.interval_of(sized["call_ms"] / 1e3, sized["check_ms"] / 1e3) + 1
    assert any("sized on this machine" in line for line in result["guard_report"])
