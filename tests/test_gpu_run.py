"""bench/gpu_run.py on the CPU: its items (each script exists and takes its arguments), the markers a call leaves
and the next call resumes from (on a warm machine, or from the results carried back), the deadline, the limits, the
background build it waits for; and its neighbours: the guard's re-fit (bench/guard_fit.py), the README's figures
(bench/results_table.py), what a call carries (bench/gpu_carry.py) and the wheels' parts (bench/device_wheels.py).
Items are tiny real processes, never mocks; the real items run where they have a CPU try (--cpu-smoke)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import device_wheels  # noqa: E402  (bench/ holds the scripts)
import gpu_carry  # noqa: E402
import gpu_items  # noqa: E402
import gpu_run  # noqa: E402
import guard_fit  # noqa: E402
import results_table  # noqa: E402
from gpu_items import Item  # noqa: E402

PY = "{python}"


def call(tmp_path, *args, items=None, work="work", out="out", resume="none"):
    """One call of the runner (its files in tmp_path/out, its machine folder tmp_path/work); its summary."""
    argv = ["--out", str(tmp_path / out), "--work", str(tmp_path / work), "--wheels", str(tmp_path / "no-wheels"),
            "--resume", str(tmp_path / resume), "--sage-source", str(tmp_path / "no-sage"), "--comfyui",
            str(tmp_path / "no-comfyui"), "--poll", "0.2", *args]
    assert gpu_run.main(argv, items=items) == 0
    return json.loads((tmp_path / out / "gpu-run-summary.json").read_text())


def writes(name, estimate=1, limit=60, seconds=0.0, needs=(), group=1):
    """An item that sleeps `seconds` and writes {out}.json."""
    code = f"import json, sys, time; time.sleep({seconds}); open(sys.argv[1], 'w').write(json.dumps({{'ok': 1}}))"
    return Item(name, group, (PY, "-c", code, "{out}.json"), estimate, limit, "a test item", needs=needs)


# --- the items ------------------------------------------------------------------------------------------------------

def test_the_dry_run_lists_every_item_in_the_issues_order_with_its_command(capsys):
    assert gpu_run.main(["--dry-run", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in rows]
    assert len(names) == len(set(names)) == len(gpu_items.ITEMS)
    assert [r["group"] for r in rows] == sorted(r["group"] for r in rows)  # issue 46's order: 1 first, 5 last
    assert names[:2] == ["guard-tests", "guard-check-time"]
    known = {"gpu", "fa3", "sage", "comfyui", "quiet"}
    for r in rows:
        assert (ROOT / r["script"]).is_file(), r
        assert all(n in known or n.startswith("after:") and n[6:] in names for n in r["needs"]), r
        assert 0 < r["estimate_s"] < r["limit_s"] <= 540 and r["basis"], r
        assert not any("{" in a for a in r["argv"] + list(r["env"].values())), r  # every placeholder filled
        assert f"RESULTS/DATE-MACHINE-{r['name']}." in " ".join(r["argv"] + list(r["env"].values())), r
    by = {r["name"]: r for r in rows}
    assert by["guard-refit"]["argv"][2] == "RESULTS/DATE-MACHINE-guard-check-time.json"
    assert "--shared-site" in by["guard-one-bad-block-shared-site"]["argv"]
    assert by["guard-one-bad-block-every1"]["argv"][-4:-2] == ["--every", "1"]
    steps = [r for r in rows if r["name"].startswith("step-table")]
    assert {(r["argv"][r["argv"].index("--models") + 1], r["argv"][r["argv"].index("--modes") + 1]) for r in steps} \
        == {("sd1.5", "eager"), ("sdxl", "eager"), ("flux", "eager"), ("wan1.3b", "eager"), ("wan1.3b", "compiled"),
            ("flux", "compiled")}
    side = [r["argv"][r["argv"].index("--shape") + 1] for r in rows if r["name"].startswith("side-by-side")]
    assert sorted(set(side)) == ["1,12,32760,128", "1,24,4608,128", "1,40,32760,128"] and len(side) == 9


@pytest.mark.slow
def test_each_items_script_takes_its_arguments():
    """Each script's own argparse parses the item's arguments (a renamed flag fails here, not on the GPU), and each
    pytest item collects tests."""
    renamed = Item("x", 1, (PY, "bench/guard_cost.py", "--scenario", "one-bad-block", "--shared-sites"), 1, 2, "")
    wrong = Item("y", 1, (PY, "bench/side_by_side.py", "--inputs", "video"), 1, 2, "")
    empty = Item("z", 1, gpu_items.PYTEST + ("tests/gpu/test_gpu_guard.py", "-k", "no_such_test"), 1, 2, "")
    missing = Item("w", 1, (PY, "bench/no_such_bench.py"), 1, 2, "")
    verdicts = gpu_run.check_args(gpu_items.ITEMS + [renamed, wrong, empty, missing])  # one process per script
    assert {i.name: verdicts[i.name] for i in gpu_items.ITEMS} == {i.name: "" for i in gpu_items.ITEMS}
    assert "unrecognized arguments: --shared-sites" in verdicts["x"]
    assert "invalid choice: 'video'" in verdicts["y"]
    assert verdicts["z"].startswith("pytest exit 5")  # no test selected
    assert verdicts["w"] == "bench/no_such_bench.py does not exist"


@pytest.mark.parametrize("name, slug", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                        ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("NVIDIA A100-SXM4-80GB", "a100"),
                                        (None, "cpu")])
def test_the_machine_in_a_results_name(name, slug):
    assert gpu_run.machine_slug(name) == slug
    assert results_table.parts(Path(f"2026-12-06-{slug}-guard-check-time.json")) == ("2026-12-06", slug,
                                                                                      "guard-check-time")


# --- markers, resume, deadline, limits ------------------------------------------------------------------------------

def test_a_second_call_resumes_on_a_warm_machine_and_from_the_results_carried_back(tmp_path):
    items = [writes("a"), writes("b", seconds=0.2), writes("c", estimate=10_000)]
    first = call(tmp_path, "--deadline", "60", items=items)
    assert [first["items"][n]["status"] for n in "abc"] == ["ok", "ok", "no time"]
    assert first["next"]["items_left"].keys() == {"c"} and not first["next"]["all_done"]
    done = tmp_path / "work" / "results" / "done"
    assert sorted(p.name for p in done.iterdir()) == ["a.json", "b.json"]
    marker = json.loads((done / "a.json").read_text())
    assert marker["status"] == "ok" and marker["files"] == [f"{marker['stem']}.json", f"{marker['stem']}.txt"]
    assert marker["stem"].endswith("-cpu-a") and marker["call"] == 1

    warm = call(tmp_path, "--deadline", "60", items=items, out="out2")  # the same machine, still warm
    assert [warm["items"][n]["status"] for n in "abc"] == ["done before", "done before", "no time"]
    assert warm["call"] == 2

    unpacked = tmp_path / "unpacked"  # a bare machine: the results come back as the archive, carried again
    with tarfile.open(tmp_path / "out2" / "gpu-run-results.tar.gz") as tar:
        tar.extractall(unpacked, filter="data")
    items[2] = writes("c")
    bare = call(tmp_path, "--deadline", "60", items=items, work="bare", out="out3", resume="unpacked")
    assert [bare["items"][n]["status"] for n in "abc"] == ["done before", "done before", "ok"]
    assert bare["call"] == 3 and bare["next"]["all_done"]
    with tarfile.open(tmp_path / "out3" / "gpu-run-results.tar.gz") as tar:
        names = tar.getnames()
    assert {"done/a.json", "done/b.json", "done/c.json", "calls/call-1.json", "calls/call-3.log"} <= set(names)
    assert sorted(p.name for p in (tmp_path / "out3").iterdir()) == ["gpu-run-results.tar.gz",
                                                                     "gpu-run-summary.json", "gpu-run.log"]


def test_an_item_cut_by_the_deadline_gets_no_marker_and_runs_again_next_call(tmp_path):
    items = [writes("slow", estimate=0, limit=120, seconds=60)]
    first = call(tmp_path, "--deadline", "15", "--reserve", "0", items=items)  # the probe takes some of it
    assert first["items"]["slow"]["status"] == "cut" and first["seconds"] < 30
    results = tmp_path / "work" / "results"
    assert not (results / "done" / "slow.json").exists() and not list(results.glob("*-slow.*"))
    assert [p.name.split("-cpu-")[1] for p in (results / "calls").glob("call-1-cut-*")] == ["slow.txt"]  # kept apart
    items[0] = writes("slow")
    second = call(tmp_path, "--deadline", "60", items=items, out="out2")
    assert second["items"]["slow"]["status"] == "ok"


def test_an_item_past_its_own_limit_is_stopped_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; child = subprocess.Popen(['sleep', '60']); "
            f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(60)")
    items = [Item("hangs", 1, (PY, "-c", code), 0, 1, "a test item", needs=()), writes("after")]
    summary = call(tmp_path, "--deadline", "60", items=items)
    assert summary["items"]["hangs"]["status"] == "timeout" and summary["items"]["after"]["status"] == "ok"
    marker = json.loads((tmp_path / "work" / "results" / "done" / "hangs.json").read_text())
    assert marker["status"] == "timeout" and marker["seconds"] < 15
    assert not gpu_run.pid_alive(int(pid_file.read_text()))  # the whole process group was ended
    again = call(tmp_path, "--deadline", "60", items=items, out="out2")  # not tried again, unless asked
    assert again["items"]["hangs"]["status"] == "done before"


def test_needs_order_the_items_and_name_what_is_missing(tmp_path):
    items = [writes("needs-b", needs=("after:b",)), writes("b"), writes("gpu", needs=("gpu",)),
             writes("after-gpu", needs=("after:gpu",)), writes("comfy", needs=("comfyui",)),
             writes("long", estimate=10_000), writes("after-long", needs=("after:long",))]
    summary = call(tmp_path, "--deadline", "60", items=items)
    status = {n: (e["status"], e.get("why", "")) for n, e in summary["items"].items()}
    assert status["after-long"] == ("skipped", "long was no time in this call") and summary["seconds"] < 30
    assert status["b"][0] == status["needs-b"][0] == "ok"  # run as soon as b was done
    assert status["gpu"] == ("skipped", "no CUDA GPU visible to torch")
    assert status["after-gpu"][0] == "skipped" and "gpu" in status["after-gpu"][1]
    assert status["comfy"][0] == "skipped" and "no ComfyUI carried" in status["comfy"][1]
    allowed = call(tmp_path, "--deadline", "60", "--allow-missing", "gpu", items=items, out="out2")
    assert allowed["items"]["gpu"]["status"] == "ok"


def test_items_wait_for_the_sagattention_build_in_the_background(tmp_path):
    """The real build command (install.py --build sageattention) runs in the background: on this CPU it refuses
    after a few seconds. An item that times the host waits for it to end; one that needs SageAttention is skipped
    with the build's reason once it has ended, and its log comes back."""
    source = tmp_path / "sage-src"
    source.mkdir()
    (source / "setup.py").write_text("version = '2.2.0'\n")
    items = [writes("needs-sage", needs=("sage",)), writes("quiet", needs=("quiet",))]
    argv = ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--wheels", str(tmp_path / "none"),
            "--resume", str(tmp_path / "none"), "--sage-source", str(source), "--deadline", "300", "--poll", "0.5"]
    assert gpu_run.main(argv, items=items) == 0
    summary = json.loads((tmp_path / "out" / "gpu-run-summary.json").read_text())
    log = (tmp_path / "out" / "gpu-run.log").read_text()
    assert "started the SageAttention build" in log and "quiet: waiting: the SageAttention build is running" in log
    assert summary["items"]["quiet"]["status"] == "ok"
    assert summary["items"]["needs-sage"]["status"] == "skipped"
    assert "the SageAttention build failed: cannot build SageAttention 2 here" in summary["items"]["needs-sage"]["why"]
    assert summary["sage"]["build"] == "done" and summary["sage"]["exit"] != 0
    results = tmp_path / "work" / "results"
    assert json.loads(next(results.glob("*-cpu-sage-build.json")).read_text())["status"] == "refused"
    assert next(results.glob("*-cpu-sage-build.txt")).stat().st_size > 0


def test_a_background_job_is_found_by_a_later_call(tmp_path):
    job = gpu_run.Background(tmp_path / "job")
    assert job.state() == ("absent", None)
    job.start([sys.executable, "-c", "import time; time.sleep(1); print('built')"], dict(os.environ))
    assert job.state() == ("running", None)
    later = gpu_run.Background(tmp_path / "job")  # the next call on a warm machine: not its child
    assert later.state() == ("running", None)
    deadline = time.monotonic() + 30
    while later.state()[0] == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert later.state() == ("done", 0) and (tmp_path / "job" / "stdout").read_text() == "built\n"
    job.proc.wait(timeout=30)  # the wrapper writes the marker, then exits: a pid is reused only once it is gone
    dead = gpu_run.Background(tmp_path / "dead")
    (tmp_path / "dead").mkdir()
    (tmp_path / "dead" / "started.json").write_text(json.dumps({"pid": job.proc.pid, "epoch": 0}))
    assert dead.state() == ("died", None)  # started, gone, no marker: a machine given back mid-build


def test_a_built_wheel_comes_back_in_parts_and_installs_from_them(tmp_path, monkeypatch):
    wheel = tmp_path / "sageattention-2.2.0-cp312-cp312-linux_x86_64.whl"
    wheel.write_bytes(os.urandom(3 * 2**20 + 5))
    run = gpu_run.Run(gpu_run_args(tmp_path), [])
    (run.work / "sage" / "wheel").mkdir(parents=True)
    (run.work / "sage" / "wheel" / wheel.name).write_bytes(wheel.read_bytes())
    monkeypatch.setattr(gpu_run, "FILE_BYTES", 2 * 2**20)  # parts of 1 MiB here, 15 MiB on the GPU
    assert run.return_sage_wheel(tmp_path / "out")
    back = sorted(p.name for p in (tmp_path / "out" / "sage").iterdir())
    assert back == ["manifest.json"] + [f"{wheel.name}.part{i}" for i in range(4)]
    assert not run.return_sage_wheel(tmp_path / "out2")  # once
    carried = tmp_path / "carried"
    (carried / "sage").mkdir(parents=True)
    for name in back:
        (carried / "sage" / name).write_bytes((tmp_path / "out" / "sage" / name).read_bytes())
    joined, missing = device_wheels.join(carried, tmp_path / "joined")
    assert missing == [] and joined[0].read_bytes() == wheel.read_bytes()
    (carried / "sage" / f"{wheel.name}.part3").unlink()
    assert device_wheels.join(carried, tmp_path / "joined2") == ([], [f"{wheel.name} (3 of 4 parts here)"])


def gpu_run_args(tmp_path):
    import argparse
    return argparse.Namespace(work=str(tmp_path / "work"), deadline=60, reserve=0, comfyui="x", before="x",
                              resume="x", wheels="x", sage_source="x", retry_failed=False, allow_missing=set())


# --- the real items on a CPU, and the README's figures ----------------------------------------------------------------

@pytest.mark.slow
def test_the_real_guard_items_run_on_a_cpu_and_their_figures_fill_the_readme(tmp_path):
    summary = call(tmp_path, "--cpu-smoke", "--deadline", "400", "--only",
                   "guard-check-time,guard-one-bad-block-int8-sim-every1")
    assert {n: e["status"] for n, e in summary["items"].items()} == {
        "guard-check-time": "ok", "guard-one-bad-block-int8-sim-every1": "ok"}
    results = tmp_path / "work" / "results"
    check = json.loads(next(results.glob("*-cpu-guard-check-time.json")).read_text())
    assert check["shapes"]["tiny"]["path"] == "torch" and check["device"] == "cpu"
    figures = {r["file"].split("-cpu-")[1]: r for r in summary["figures"]}
    spoiled = figures["guard-one-bad-block-int8-sim-every1.json"]
    assert spoiled["target"] == "0" and spoiled["met"] is True and spoiled["measured"].startswith("0 of 48")
    readme = tmp_path / "README.md"
    readme.write_text(f"# Results\n{results_table.START}\nno run yet\n{results_table.END}\n## Older\n")
    assert results_table.main([str(results), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "no run yet" not in text and text.endswith(f"{results_table.END}\n## Older\n")
    assert "| one bad block of 8 from step 2 of 6 (`bench_int8_sim`, every call checked): spoiled calls | 0 of 48" \
        in text and "torch 2." in text
    copied = [p.name for p in tmp_path.iterdir()]  # beside the README, so its links resolve
    assert any(n.endswith("-cpu-guard-check-time.json") for n in copied)
    assert any(n.endswith("-cpu-gpu-run.json") for n in copied)


def test_the_readme_has_one_figures_slot():
    text = (ROOT / "bench" / "results" / "README.md").read_text()
    assert text.count(results_table.START) == 1 and text.count(results_table.END) == 1
    assert text.index(results_table.START) < text.index("## 2026-12-05")  # the latest figures first


def test_the_figures_read_every_kind_of_result(tmp_path):
    stem = tmp_path / "2026-12-06-h100-"
    shape = {"shape_bshd": [1, 32760, 12, 128], "len_kv": 32760, "check_ms": 0.15, "call_ms": 9.5,
             "check_share_of_call": 0.0158, "model_check_ms": 0.2, "measured_interval": 30, "model_interval": 8, "check_extra_peak_mib": 2.0,
             "path": "triton"}
    Path(f"{stem}guard-check-time.json").write_text(json.dumps({"shapes": {"wan1.3b": shape, "wan14b": {
        **shape, "check_share_of_call": 0.03, "check_extra_peak_mib": 12.5}}}))
    Path(f"{stem}guard-call-cost.json").write_text(json.dumps({"backend": "auto_fast", "shapes": {"wan14b": {
        "added_share": {"default": 0.004, "every 2": 0.05, "every 1": 0.09},
        "checks_per_call": {"default": 0.02}, "served": ["sage_sm90_per_warp"]}}}))
    Path(f"{stem}small-call.json").write_text(json.dumps({"dispatcher_minus_bare_host_us": 4.2,
                                                         "override_minus_comfy_optimized_host_us": 3.5}))
    Path(f"{stem}step-table-sdxl.json").write_text(json.dumps({"table": [
        {"model": "sdxl", "mode": "eager", "attention": "comfy default", "ms": 60.0, "vs_comfy": 1.0, "served": []},
        {"model": "sdxl", "mode": "eager", "attention": "auto_exact", "ms": 57.0, "vs_comfy": 1.053,
         "vs_best_pinned": 0.995, "served": ["native"]}], "device": "NVIDIA H100", "runs": 20, "failed": {}}))
    Path(f"{stem}guard-tests.xml").write_text('<testsuites><testsuite tests="10" failures="1" errors="0" '
                                              'skipped="2"/></testsuites>')
    rows = {(r["what"], r["met"]) for r in results_table.figures(tmp_path)}
    assert ("the check on WAN 1.3B self-attention: its time / the call's (triton)", True) in rows
    assert ("the check on Wan 14B self-attention: its time / the call's (triton)", False) in rows
    assert ("the check's extra peak memory on Wan 14B self-attention", False) in rows
    assert any(w.startswith("the guard on Wan 14B self-attention calls (`auto_fast`") and m for w, m in rows)
    assert ("a repeat call's host time: the dispatcher over bare SDPA", True) in rows
    assert ("a repeat call's host time: the override over ComfyUI's own attention", False) in rows
    assert ("sdxl step, eager: `auto_exact` / the best pinned kernel", True) in rows
    assert ("tests: guard-tests", False) in rows
    text = results_table.markdown(tmp_path, None)
    assert "| sdxl | eager | auto_exact | 57.00 | 1.053 | 0.995 | native |" in text  # step_table's own table
    Path(f"{stem}guard-refit.json").write_text("{not json")
    assert any(r["what"].endswith("guard-refit.json: not read") for r in results_table.figures(tmp_path))


# --- the guard's re-fit ---------------------------------------------------------------------------------------------

def synthetic_check_time(shapes, **true):
    """What check-time would measure if the cost model held with the constants `true`."""
    from guard_cost import CHECK_SHAPES
    rows = {}
    with guard_fit.constants(**true):
        for name in shapes:
            b, lq, h, d, lk = CHECK_SHAPES[name]
            row = {"shape_bshd": [b, lq, h, d], "len_kv": lk, "path": "triton"}
            inputs = guard_fit.inputs_of(row, "bfloat16")
            rows[name] = {**row, "check_ms": guard_fit.guard.check_seconds(inputs, kernel=True) * 1e3,
                          "call_ms": guard_fit.guard.call_seconds(inputs) * 1e3}
    return {"device": "NVIDIA H100 80GB HBM3", "shapes": rows}


def test_the_refit_recovers_the_constants_behind_the_measurements():
    true = {"CHECK_HOST_S": 2.2e-4, "MEMORY_BYTES_S": 1.9e12, "CHECK_FLOPS": 1.2e13}
    result = guard_fit.fit(synthetic_check_time(["wan1.3b", "wan14b", "flux", "sdxl", "sdxl-1024", "sdxl-cross"],
                                                **true))
    assert result["fitted"] == pytest.approx(true, rel=1e-2) and result["largest_relative_error_after"] < 1e-3
    assert result["current"]["CHECK_HOST_S"] == guard_fit.guard.CHECK_HOST_S  # guard.py itself is left as it is
    wan = result["shapes"]["wan1.3b"]
    assert wan["model_ms_after"] == pytest.approx(wan["check_ms"], rel=1e-3)


def test_without_a_cross_attention_shape_the_refit_keeps_check_flops_and_says_so():
    true = {"CHECK_HOST_S": 1.5e-4, "MEMORY_BYTES_S": 3.0e12, "CHECK_FLOPS": guard_fit.guard.CHECK_FLOPS}
    result = guard_fit.fit(synthetic_check_time(["wan1.3b", "wan14b", "flux", "sdxl"], **true))
    assert result["fitted"]["CHECK_FLOPS"] == pytest.approx(guard_fit.guard.CHECK_FLOPS)
    assert result["fitted"]["MEMORY_BYTES_S"] == pytest.approx(3.0e12, rel=1e-2)
    assert "no cross-attention shape" in result["note"]


def test_the_refit_refuses_a_run_without_the_check_kernel():
    with pytest.raises(SystemExit, match="Triton kernel"):
        guard_fit.fit({"device": "cpu", "shapes": {"tiny": {"path": "torch", "check_ms": 1.0}}})


# --- what a call carries --------------------------------------------------------------------------------------------

def test_the_carried_comfyui_keeps_the_model_code_and_leaves_the_tokenizer_data(tmp_path):
    source = tmp_path / "ComfyUI"
    for name in ("comfy/ldm/wan/model.py", "comfy/ops.py", "comfy/text_encoders/t5_tokenizer/tokenizer.json",
                 "comfy/sd1_tokenizer/vocab.json", "comfyui_version.py", "nodes.py", "web/index.html"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text("x")
    gpu_carry.comfyui(source, tmp_path / "carried")
    kept = sorted(str(p.relative_to(tmp_path / "carried")) for p in (tmp_path / "carried").rglob("*") if p.is_file())
    assert kept == ["comfy/ldm/wan/model.py", "comfy/ops.py", "comfyui_version.py"]
    with pytest.raises(SystemExit, match="not a ComfyUI checkout"):
        gpu_carry.comfyui(tmp_path / "carried" / "comfy", tmp_path / "again")


def test_unpack_puts_the_results_and_the_wheel_where_the_next_call_carries_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_carry, "GPU", tmp_path / ".gpu")
    monkeypatch.setattr(gpu_carry, "WHEELS", tmp_path / ".whl" / "gpu")
    files = tmp_path / "files"
    (files / "sage").mkdir(parents=True)
    (files / "sage" / "manifest.json").write_text("[]")
    (tmp_path / "r" / "done").mkdir(parents=True)
    (tmp_path / "r" / "done" / "a.json").write_text("{}")
    with tarfile.open(files / "gpu-run-results.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "r" / "done" / "a.json", arcname="done/a.json")
    (files / "gpu-run-summary.json").write_text(json.dumps({"items": {"a": {"status": "ok", "seconds": 1.0}}}))
    (tmp_path / ".gpu" / "resume" / "stale").mkdir(parents=True)
    gpu_carry.main(["unpack", str(files)])
    assert sorted(str(p.relative_to(tmp_path / ".gpu" / "resume")) for p in (tmp_path / ".gpu" / "resume").rglob("*")) \
        == ["done", "done/a.json"]
    assert (tmp_path / ".whl" / "gpu" / "sage" / "manifest.json").exists()
    out = capsys.readouterr().out
    assert "  a: ok in 1.0 s" in out and 'command="python3 bench/gpu_run.py --commit' in out


def test_each_wheel_set_is_closed_on_its_own_and_the_first_is_small():
    assert list(device_wheels.SETS)[0] == "first"
    assert {p.split("==")[0] for p in device_wheels.SETS["first"]} == {"fa3-fwd", "kernels", "tomlkit"}
    assert len(device_wheels.PINNED) == len(set(device_wheels.PINNED))
    assert device_wheels.distribution(Path("fa3_fwd-0.0.3-cp39-abi3-manylinux_2_24_x86_64.whl")) == "fa3-fwd"


@pytest.mark.integration
def test_the_carried_comfyui_is_enough_for_the_model_step_and_the_small_call(tmp_path):
    """The trimmed ComfyUI a call carries (bench/gpu_carry.py) runs a step-table item at toy size (one mode, the
    kernels asked for that can run) and the small call against ComfyUI's own attention, on a CPU."""
    from helpers import comfyui
    carried = tmp_path / "ComfyUI"
    gpu_carry.comfyui(Path(comfyui.COMFYUI_PATH), carried)
    env = dict(os.environ, COMFYUI_PATH=str(carried), ATTN_DISPATCH_TUNE_CACHE="off", CUDA_VISIBLE_DEVICES="")
    step, small = tmp_path / "step.json", tmp_path / "small.json"
    for argv in (["bench/comfy_model_step.py", "--table", "--models", "tiny-flux,tiny-sd1.5", "--modes", "eager",
                  "--kernels", "native,flash_4", "--runs", "1", "--warmup", "1", "--json", str(step)],
                 ["bench/small_call.py", "--device", "cpu", "--shape", "1,2,16,64", "--rounds", "2", "--calls", "5",
                  "--json", str(small)]):
        done = subprocess.run([comfyui.COMFYUI_PYTHON, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(step.read_text())
    assert {(r["model"], r["mode"]) for r in data["table"]} == {("tiny-flux", "eager"), ("tiny-sd1.5", "eager")}
    assert data["kernels"] == ["native"] and data["failed"]["pinned flash_4"].startswith("unavailable: ")
    assert "override_minus_comfy_optimized_host_us" in json.loads(small.read_text())


def test_the_carried_wheels_are_installed_on_the_items_path(tmp_path):
    """A batch as bench/device_wheels.py packs it (a wheel, its manifest) is joined, checked, installed with pip
    --target once per machine, and importable by the items; a wheel with parts missing is named, not installed."""
    import zipfile
    wheel = tmp_path / "gpu_run_probe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("gpu_run_probe.py", "WHERE = __file__\n")
        z.writestr("gpu_run_probe-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: gpu-run-probe\nVersion: 1.0\n")
        z.writestr("gpu_run_probe-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                        "Tag: py3-none-any\n")
        z.writestr("gpu_run_probe-1.0.dist-info/RECORD", "")
    batch = tmp_path / "wheels" / "batch-1"
    batch.mkdir(parents=True)
    wheel.rename(batch / wheel.name)
    device_wheels.write_batch(batch, [{"path": batch / wheel.name, "wheel": wheel.name, "part": 0, "parts": 1}],
                              {wheel.name: device_wheels.sha256(batch / wheel.name)}, "first")
    (tmp_path / "wheels" / "fa4").mkdir()
    (tmp_path / "wheels" / "fa4" / "manifest.json").write_text(json.dumps([{
        "file": "big.whl.part1", "wheel": "big.whl", "part": 1, "parts": 2, "sha256": "0"}]))
    code = "import sys, gpu_run_probe; open(sys.argv[1], 'w').write(gpu_run_probe.WHERE)"
    items = [Item("imports", 1, (PY, "-c", code, "{out}.txt"), 1, 60, "a test item", needs=())]
    summary = call(tmp_path, "--deadline", "120", "--wheels", str(tmp_path / "wheels"), items=items)
    assert summary["items"]["imports"]["status"] == "ok"
    assert summary["wheels"] == {"installed": [wheel.name], "incomplete": ["big.whl (0 of 2 parts here)"]}
    site = tmp_path / "work" / "site"
    assert next((tmp_path / "work" / "results").glob("*-imports.txt")).read_text().startswith(str(site))
    log = (tmp_path / "out" / "gpu-run.log").read_text()
    assert "installed 1 wheels" in log and "wheels left out (not every part carried): big.whl" in log
    again = call(tmp_path, "--deadline", "60", "--wheels", str(tmp_path / "wheels"), items=items, out="out2")
    assert "installed 1 wheels" not in (tmp_path / "out2" / "gpu-run.log").read_text()  # once per machine
    assert again["wheels"]["installed"] == [wheel.name] and again["items"]["imports"]["status"] == "done before"


def test_results_copied_beside_the_readme_name_no_machine_path():
    """What a GPU machine printed names its own folders; the copies in bench/results name none of them."""
    text = ("python3 at /opt/torch/.venv/bin/python3 ran /home/user/pack/bench/side_by_side.py into /tmp/gpu-run/results/x, "
            "recorded in /home/user/pack/kernels.lock.json, log /tmp/sage-build.log, tmp /tmp/pytest-of-root/pytest-2/t0")
    assert results_table.scrub(text) == (
        "python3 at <venv>/bin/python3 ran bench/side_by_side.py into <gpu_run work>/results/x, recorded in "
        "kernels.lock.json, log <tmp>/sage-build.log, tmp <pytest tmp>/t0")
