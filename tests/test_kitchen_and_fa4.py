"""comfy-kitchen's INT8 attention and block-sparse sol_attn, and the local FlashAttention-4: what each declares,
what it refuses and why, and the approximate class (sol_attn) in `auto` and the quality guard.

None of the three kernels runs on a CPU: their specs, reasons and install steps are read on simulated machines
(the `use_machine` seam); the approximate class is exercised with a real windowed kernel on the CPU. The kernels
themselves are checked against exact attention in tests/gpu/test_gpu_backends.py.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import dispatcher
from dispatcher import Machine, Recorder, availability_reasons, dispatch_attention_fn, get_backend_spec, model_scope
from dispatcher import auto, guard, guard_rules, recording, use_machine
from dispatcher.auto import Tuner
from dispatcher.backends import kitchen
from dispatcher.inputs import AttentionInputs, describe_call
from dispatcher.tools import doctor
from helpers import fake_clock
from helpers.tensors import qkv, sdpa as exact

TORCH = "2.13.0"
NEW = ("flash_4", "comfy_kitchen_int8", "sol_attn")


def cuda_machine(capability=(9, 0), **packages) -> Machine:
    return Machine(torch_version=TORCH, device_type="cuda", device_name="NVIDIA GPU", cuda_capability=capability,
                   cuda_version="12.8", packages={"torch": TORCH, **packages}, simulated=True)


H200 = cuda_machine((9, 0), **{"comfy-kitchen": "0.2.40", "flash-attn-4": "4.0.0b40"})


def call(*, b=1, lq=64, lk=None, h=4, hk=None, d=128, dv=None, dtype=torch.bfloat16, mask=None, **flags):
    """The description of a call on a CUDA device (the tensors stay on the CPU; only the description moves)."""
    q, k, v = qkv(b, lq, lk, h=h, d=d, dv=dv, hk=hk, dtype=dtype)
    inputs = describe_call(q, k, v, mask, flags.get("dropout_p", 0.0), flags.get("is_causal", False),
                           flags.get("scale"), flags.get("enable_gqa", hk is not None), flags.get("return_lse", False),
                           "BSHD")
    if flags.get("requires_grad"):
        inputs = dataclasses.replace(inputs, requires_grad=True)
    dev = torch.device("cuda")
    return dataclasses.replace(inputs, device=dev, key_device=dev, value_device=dev)


def reasons(name, inputs, machine=H200) -> list[str]:
    with use_machine(machine):
        return get_backend_spec(name).not_supported_reasons(inputs)


def test_the_classes():
    int8, sol, fa4 = (get_backend_spec(n) for n in ("comfy_kitchen_int8", "sol_attn", "flash_4"))
    assert (int8.precision, sol.precision, fa4.precision) == ("quantised", "approximate", "exact")
    assert not int8.exact and not sol.exact and fa4.exact
    assert sol.constraints()["approximate"] and sol.constraints()["precision"] == "approximate"
    # the approximate kernel is judged and guarded by its own declared bound, the quantised one by auto_fast's
    assert auto.tuner.admission_bound(sol) == kitchen.SOL_ATTN_BOUND and guard.bound_for(sol) == 2 * kitchen.SOL_ATTN_BOUND
    assert auto.tuner.admission_bound(int8) == auto.FAST_BOUND and guard.bound_for(int8) == 2 * auto.FAST_BOUND == 0.1
    inputs = AttentionInputs.of(1, 2, 4096, 128)
    assert guard_rules.rules_for(sol, guard.DEFAULT, inputs).every
    assert guard_rules.rules_for(int8, guard.DEFAULT, inputs).every
    assert guard_rules.rules_for(fa4, guard.DEFAULT, inputs) is None  # watched by default: the two that are not exact


def test_what_each_needs_on_a_cpu_and_on_a_gpu_without_the_packages():
    cpu = Machine(torch_version=TORCH, device_type="cpu", device_name="cpu", packages={"torch": TORCH}, simulated=True)
    for name in NEW:
        why = availability_reasons(name, cpu)
        assert any("needs an NVIDIA CUDA GPU; this machine has a CPU" in r for r in why), (name, why)
    bare = cuda_machine((9, 0))
    assert availability_reasons("comfy_kitchen_int8", bare) == \
        ["comfy-kitchen is not installed: pip install 'comfy-kitchen>=0.2.36'"]
    assert availability_reasons("flash_4", bare)[0].startswith(
        "flash-attn-4 is not installed: pip install 'flash-attn-4>=4.0.0b40'")
    old_beta = cuda_machine((9, 0), **{"flash-attn-4": "4.0.0b36", "comfy-kitchen": "0.2.35"})
    assert "flash-attn-4 4.0.0b36 is older than the required 4.0.0b40" in availability_reasons("flash_4", old_beta)[0]
    assert "comfy-kitchen 0.2.35 is older than the required 0.2.36" in availability_reasons("sol_attn", old_beta)[0]
    pinned = cuda_machine((9, 0), **{"comfy-kitchen": "0.2.36"})  # what ComfyUI 0.38 installs: enough
    assert availability_reasons("sol_attn", pinned) == [] and availability_reasons("comfy_kitchen_int8", pinned) == []
    for name in NEW:
        assert availability_reasons(name, H200) == [], name


@pytest.mark.parametrize("capability, available", [
    ((7, 5), {"comfy_kitchen_int8"}), ((8, 0), {"comfy_kitchen_int8", "sol_attn"}), ((8, 6), {"comfy_kitchen_int8", "sol_attn"}),
    ((9, 0), set(NEW)), ((10, 0), set(NEW)), ((12, 0), set(NEW)), ((7, 0), set())])
def test_gpu_generations(capability, available):
    machine = cuda_machine(capability, **{"comfy-kitchen": "0.2.40", "flash-attn-4": "4.0.0b40"})
    assert {n for n in NEW if not availability_reasons(n, machine)} == available
    if "flash_4" not in available:
        assert any(f"sm_{capability[0]}{capability[1]}" in r for r in availability_reasons("flash_4", machine))


def test_int8_takes_what_comfyuis_kernel_takes():
    assert reasons("comfy_kitchen_int8", call()) == []
    assert reasons("comfy_kitchen_int8", call(dtype=torch.float32)) == []  # computed through bfloat16
    assert reasons("comfy_kitchen_int8", call(d=40)) == []  # padded to 64 and sliced back
    assert reasons("comfy_kitchen_int8", call(d=256)) == []
    assert reasons("comfy_kitchen_int8", call(h=8, hk=2)) == []  # grouped-query attention
    assert reasons("comfy_kitchen_int8", call(lq=64, lk=77)) == []  # text cross-attention
    assert reasons("comfy_kitchen_int8", call(lq=64, lk=77, mask=torch.ones(1, 1, 64, 77, dtype=torch.bool))) == []
    assert reasons("comfy_kitchen_int8", call(lq=64, lk=77, mask=torch.zeros(1, 1, 64, 77))) == []
    assert reasons("comfy_kitchen_int8", call(lq=64, lk=77, mask=torch.ones(2, 1, 1, 77, dtype=torch.bool), b=2)) == []


@pytest.mark.parametrize("inputs, why", [
    (dict(is_causal=True), "is_causal=True is not supported"),
    (dict(return_lse=True), "return_lse=True is not supported"),
    (dict(d=320), "head dim 320 is not supported (supported: 1..256)"),
    (dict(dv=64), "value head dim 64 differs from query head dim 128"),
    (dict(dropout_p=0.1), "dropout_p > 0 is not supported"),
    (dict(requires_grad=True), "has no backward pass"),
    (dict(dtype=torch.float64), "dtype float64 is not supported (supported: bfloat16, float16, float32)"),
])
def test_int8_refusals(inputs, why):
    assert any(why in r for r in reasons("comfy_kitchen_int8", call(**inputs))), reasons("comfy_kitchen_int8", call(**inputs))


def test_sol_attn_takes_long_self_attention_of_head_dim_128():
    assert reasons("sol_attn", call(lq=4096, h=12)) == []
    assert reasons("sol_attn", call(lq=4096, h=12, dtype=torch.float16)) == []


@pytest.mark.parametrize("inputs, why", [
    (dict(d=64), "head dim 64 is not supported (supported: 128)"),
    (dict(lq=64, lk=512), "cross-attention (Lq=64 != Lk=512) is not supported: sol_attn routes self-attention only"),
    (dict(h=8, hk=2), "grouped-query attention (8 query heads, 2 key/value heads) is not supported"),
    (dict(mask=torch.ones(1, 1, 64, 64, dtype=torch.bool)), "attn_mask is a bool mask (it takes no mask"),
    (dict(dtype=torch.float32), "dtype float32 is not supported (supported: bfloat16, float16)"),
    (dict(is_causal=True), "is_causal=True is not supported"),
    (dict(return_lse=True), "return_lse=True is not supported"),
    (dict(requires_grad=True), "has no backward pass"),
])
def test_sol_attn_refusals(inputs, why):
    got = reasons("sol_attn", call(**inputs))
    assert any(why in r for r in got), got


def test_flash_4_head_dims_per_generation():
    ok = cuda_machine((9, 0), **{"flash-attn-4": "4.0.0b40"})
    blackwell = cuda_machine((10, 0), **{"flash-attn-4": "4.0.0b40"})
    geforce = cuda_machine((12, 0), **{"flash-attn-4": "4.0.0b40"})
    assert reasons("flash_4", call(d=256), ok) == [] and reasons("flash_4", call(d=192), ok) == []
    assert reasons("flash_4", call(d=256), blackwell) == [] and reasons("flash_4", call(d=128), blackwell) == []
    assert reasons("flash_4", call(d=192), blackwell) == [
        "head dim 192 is not supported by FlashAttention-4 on sm_100 (supported there: 8..128 or 256, multiple of 8)"]
    assert reasons("flash_4", call(d=256), geforce) == [
        "head dim 256 is not supported by FlashAttention-4 on sm_120 (supported there: 8..128, multiple of 8)"]
    assert reasons("flash_4", call(d=40), ok) == [] and reasons("flash_4", call(d=36), ok)  # multiples of 8


@pytest.mark.parametrize("inputs, why", [
    (dict(mask=torch.ones(1, 1, 64, 64, dtype=torch.bool)), "attn_mask is a bool mask (it takes no mask"),
    (dict(is_causal=True, lq=64, lk=128), "would align the diagonal bottom-right instead of SDPA's top-left"),
    (dict(dtype=torch.float32), "dtype float32 is not supported (supported: bfloat16, float16)"),
    (dict(dropout_p=0.1), "dropout_p > 0 is not supported"),
    (dict(requires_grad=True), "has no backward pass"),
])
def test_flash_4_refusals(inputs, why):
    got = reasons("flash_4", call(**inputs))
    assert any(why in r for r in got), got


def test_flash_4_takes_gqa_lse_and_causal_self_attention():
    assert reasons("flash_4", call(h=8, hk=2, return_lse=True)) == []
    assert reasons("flash_4", call(is_causal=True)) == []


def test_auto_exact_lists_why_it_skips_them():
    with use_machine(H200):
        names, skipped, _ = Tuner(cache_path=None, backends=NEW).candidates(call(lq=4096), exact=True)
    skipped = dict(skipped)
    assert skipped["sol_attn"] == ["an approximate kernel: auto_exact runs exact kernels only"]
    assert skipped["comfy_kitchen_int8"] == ["a quantised kernel: auto_exact runs exact kernels only"]
    assert "flash_4" in names


def test_doctor_and_the_dropdown_say_why_they_cannot_run_here():
    """The doctor's table and the backends route (the dropdown's source) carry the registry's reasons: on this CPU
    the device reason; on a Hopper GPU without the packages, what to pip install."""
    for machine, words in ((None, ("needs an NVIDIA CUDA GPU",)), (cuda_machine((9, 0)), ("comfy-kitchen", "flash-attn-4"))):
        with contextlib.nullcontext() if machine is None else use_machine(machine):
            data = doctor.report()
            text = doctor.render(data)
        rows = {b["name"]: b for b in data["backends"]}
        for name in NEW:
            assert not rows[name]["available"] and rows[name]["reasons"], name
            assert rows[name]["precision"] == get_backend_spec(name).precision
            assert name in text
        assert all(word in text for word in words), text


def test_tau():
    assert kitchen.tau_problem(1.0) is None and kitchen.tau_problem(0) is None and kitchen.tau_problem(4.0) is None
    for bad in (-0.1, 4.5, float("nan"), float("inf"), "1.0", None, True):
        assert "tau must be a number from 0 to 4 (higher is sparser)" in kitchen.tau_problem(bad)
    with pytest.raises(ValueError, match="sol_attn: tau must be a number from 0 to 4"):
        with kitchen.sol_attn_options(tau=9):
            pass


# --- the approximate class in auto_fast and the guard, with a real windowed kernel on the CPU ---------------

WINDOW = 8


def windowed(q, k, v, **_):
    """Each query attends the keys within WINDOW positions of it only: exact where the model's attention is that
    local, far off where it is not (what a block-sparse kernel does)."""
    i = torch.arange(q.shape[1])
    near = (i[:, None] - i[None, :]).abs() <= WINDOW
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=near).transpose(1, 2)


CLOCK = fake_clock.FakeClock()  # the tuner's clock with `approximate_pair`: only slow_exact takes time on it
slow_exact = CLOCK.kernel(20)  # exact, and slower than the windowed kernel


def local_activations(length=128, heads=2, dim=16, scale=3.0):
    """Query = key = a smooth positional code: each token's scores peak at its neighbours (local attention)."""
    pos = torch.arange(length)[:, None].float()
    freqs = torch.tensor([0.05, 0.11, 0.23, 0.37, 0.5, 0.7, 0.9, 1.3])
    code = torch.cat([torch.cos(pos * freqs), torch.sin(pos * freqs)], -1)[None, :, None, :].expand(1, length, heads, dim)
    q = scale * code + 0.1 * torch.randn(1, length, heads, dim, generator=torch.Generator().manual_seed(1))
    _, _, v = qkv(1, length, h=heads, d=dim, seed=2)
    return q.contiguous(), q.clone(), v


@pytest.fixture
def approximate_pair(tmp_path, monkeypatch):
    fake_clock.use(monkeypatch, CLOCK)
    names = ("t_windowed", "t_exact")
    dispatcher.register_backend(names[0], windowed, devices=("cpu",), approximate=True, error_bound=1e-1)
    dispatcher.register_backend(names[1], slow_exact, devices=("cpu",))
    dispatcher.registry.set_priority(names + tuple(dispatcher.registry.names()))
    yield names, Tuner(cache_path=tmp_path / "tune.json", backends=names)


def served(rec) -> set[str]:
    return {row["served"] for row in rec.snapshot()["rows"]}


def test_auto_fast_admits_an_approximate_kernel_within_its_own_bound_on_local_attention(approximate_pair):
    (sparse, exactly), tuner = approximate_pair
    q, k, v = local_activations()
    with auto.using(tuner), model_scope("video-model"):
        rec = Recorder()
        with recording(rec):
            out = dispatch_attention_fn(q, k, v, backend="auto_fast")
        assert served(rec) == {sparse}
        record = next(r for r in tuner.records() if not r.exact)
        chosen = {c.name: c for c in record.candidates}[sparse]
        assert chosen.error_bound == 1e-1 and chosen.rel_error < 1e-2
        torch.testing.assert_close(out, exact(q, k, v), atol=1e-2, rtol=1e-2)
        rec = Recorder()
        with recording(rec):
            dispatch_attention_fn(q, k, v, backend="auto_exact")
        assert served(rec) == {exactly}


def test_auto_fast_rejects_it_where_attention_is_not_local(approximate_pair):
    (sparse, exactly), tuner = approximate_pair
    q, k, v = qkv(1, 128, h=2, d=16, seed=3)
    rec = Recorder()
    with auto.using(tuner), model_scope("unstructured"), recording(rec):
        out = dispatch_attention_fn(q, k, v, backend="auto_fast")
    assert served(rec) == {exactly}
    torch.testing.assert_close(out, exact(q, k, v))
    bad = {c.name: c for c in tuner.records()[0].rejected}[sparse]
    assert bad.rel_error > 1e-1 and "own activations" in bad.reason


def test_noise_never_admits_an_approximate_kernel(approximate_pair):
    (sparse, exactly), _ = approximate_pair
    record = Tuner(cache_path=None, backends=(sparse, exactly)).tune(
        dispatcher.AttentionInputs.of(1, 2, 128, 16, dtype=torch.float32, device="cpu"))
    assert record.chosen == exactly
    assert {c.name: c.status for c in record.candidates}[sparse] == "unjudged"


def test_the_guard_recomputes_an_approximate_kernel_past_twice_its_bound(approximate_pair):
    """Chosen explicitly, the windowed kernel is watched by default; on unstructured values its first call fails
    the check and is recomputed exactly."""
    (sparse, exactly), _ = approximate_pair
    q, k, v = qkv(1, 128, h=2, d=16, seed=4)
    rec = Recorder()
    with recording(rec):
        out = dispatch_attention_fn(q, k, v, backend=sparse, model="m")
    torch.testing.assert_close(out, exact(q, k, v))
    (entry,) = rec.snapshot()["guard"]
    assert entry["backend"] == sparse and entry["failures"]
    assert "exceeds its guard bound 2e-01" in str(entry["failures"][0])


def test_sol_attn_call_on_comfy_kitchens_own_cpu_reference():
    """Where comfy-kitchen is installed (.ci/run installs it in the test venvs), its eager Sol-Attn (the
    algorithm in full precision, which runs on a CPU) through the pack's call: the layout and arguments are right,
    tau reaches it, and on video-like local activations it stays far within the declared bound while on noise it is
    far off. Measured with comfy-kitchen 0.2.40 on a 4x16x32 grid: 1.0e-3 (tau 0.5), 1.5e-3 (1.0), 7.8e-3 (2.0);
    0.73 on N(0,1) noise."""
    pytest.importorskip("comfy_kitchen")
    from dispatcher.reference import exact_attention, relative_error
    from dispatcher.tools.bench import local_video_qkv
    q, k, v = local_video_qkv(1, 2, 4, 16, 32, 128, device="cpu", dtype=torch.float32)
    ref, _ = exact_attention(q, k, v, with_lse=False)
    errors = {}
    for tau in (0.5, 1.0, 2.0):
        with kitchen.sol_attn_options(tau):
            out = kitchen.sol_attn_call(q, k, v, None, 0.0, False, None, False, False)
        assert out.shape == q.shape
        errors[tau] = relative_error(out.transpose(1, 2).double(), ref)
    assert errors[0.5] <= errors[1.0] <= errors[2.0] < kitchen.SOL_ATTN_BOUND / 5, errors
    noise = torch.randn(3, 1, 2048, 2, 128, generator=torch.Generator().manual_seed(0))
    ref, _ = exact_attention(*noise, with_lse=False)
    out = kitchen.sol_attn_call(*noise, None, 0.0, False, None, False, False)
    assert relative_error(out.transpose(1, 2).double(), ref) > 0.5


# --- FlashAttention-4's install: the CuTe DSL's Python package comes in nvidia-cutlass-dsl-libs-core ---------------

def test_flash_4_without_the_dsls_core_names_the_wheel_that_carries_cutlass_cute(monkeypatch, tmp_path):
    """The H200's wheel set (installed --no-deps) had nvidia-cutlass-dsl-libs-base, whose `cutlass/_mlir` makes
    `cutlass` import as a namespace package, and not -libs-core, which carries `cutlass/__init__.py` and
    `cutlass/cute`. The reason and install.py's step name that wheel at the DSL's version, never
    `--force-reinstall` (which would reinstall torch and every other requirement too)."""
    import importlib.util
    from dispatcher.backends.flash import FA4
    from dispatcher.requirements import forget_imports
    from dispatcher.tools import install_plan
    (tmp_path / "cutlass" / "_mlir").mkdir(parents=True)  # what -libs-base installs: no __init__.py, no cute
    (tmp_path / "fake_fa4").mkdir()
    (tmp_path / "fake_fa4" / "__init__.py").write_text("from cutlass.cute.runtime import from_dlpack\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.util.find_spec("cutlass") is not None  # the half-installed DSL: `cutlass` is there
    package = dataclasses.replace(FA4, module="fake_fa4")
    machine = cuda_machine((9, 0), **{"flash-attn-4": "4.0.0b40", "nvidia-cutlass-dsl": "4.8.1"})
    machine = dataclasses.replace(machine, simulated=False)  # the import is tried for real
    forget_imports()
    try:
        reason = package.reason(machine)
        command = install_plan._package_step(package, machine)[1].command
    finally:
        forget_imports()
    assert "No module named 'cutlass.cute'" in reason, reason
    assert reason.endswith("`cutlass.cute` comes in nvidia-cutlass-dsl-libs-core, which an install without "
                           "dependencies leaves out: pip install 'nvidia-cutlass-dsl-libs-core==4.8.1'"), reason
    assert command == "pip install 'nvidia-cutlass-dsl-libs-core==4.8.1'"
    assert "force-reinstall" not in reason and "nvidia-cutlass-dsl" in FA4.distributions  # its version is tracked


def test_the_device_wheel_set_carries_the_dsls_core_and_checks_its_closure(tmp_path):
    """bench/device_wheels.py: the pinned set has nvidia-cutlass-dsl-libs-core at the DSL's version, and `unmet`
    finds a requirement the set lacks in the wheels' own metadata (as -libs-base 4.8.1 declares -libs-core)."""
    import sys
    import zipfile
    from pathlib import Path
    bench = str(Path(__file__).resolve().parents[1] / "bench")
    sys.path.insert(0, bench)
    try:
        import device_wheels
    finally:
        sys.path.remove(bench)
    pins = dict(p.split("==") for p in device_wheels.PINNED)
    assert pins["nvidia-cutlass-dsl-libs-core"] == pins["nvidia-cutlass-dsl-libs-base"] == pins["nvidia-cutlass-dsl"]

    def wheel(name, *requires):
        path = tmp_path / f"{name.replace('-', '_')}-4.8.1-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(f"{name}-4.8.1.dist-info/METADATA", "\n".join(
                ["Metadata-Version: 2.4", f"Name: {name}", "Version: 4.8.1"]
                + [f"Requires-Dist: {r}" for r in requires]) + "\n")
        return path
    dsl = wheel("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base==4.8.1", "nvidia-cutlass-dsl-libs-cu12==4.8.1",
                'nvidia-cutlass-dsl-libs-cu13==4.8.1; extra == "cu13"')
    base = wheel("nvidia-cutlass-dsl-libs-base", "typing-extensions>=4.10.0", "nvidia-cutlass-dsl-libs-core==4.8.1",
                 'backports.strenum; python_version < "3.11"')
    cu13 = wheel("nvidia-cutlass-dsl-libs-cu13", "nvidia-cutlass-dsl-libs-base==4.8.1")
    assert device_wheels.unmet([dsl, base, cu13], "13") == [
        "nvidia-cutlass-dsl-libs-base requires nvidia-cutlass-dsl-libs-core==4.8.1"]
    core = wheel("nvidia-cutlass-dsl-libs-core", "typing-extensions>=4.10.0")
    assert device_wheels.unmet([dsl, base, cu13, core], "13") == []
    assert device_wheels.unmet([dsl, base, cu13, core], "12,13") == [
        "nvidia-cutlass-dsl requires nvidia-cutlass-dsl-libs-cu12==4.8.1"]


# --- comfy-kitchen: the floor is ComfyUI's own pin ----------------------------------------------------------------

def test_the_floor_never_fights_comfyuis_pin():
    """ComfyUI 0.38 pins comfy-kitchen==0.2.36: the pack's floor and install advice must accept it."""
    from dispatcher.versions import at_least
    assert at_least(kitchen.COMFYUI_PIN, kitchen.KITCHEN.min_version)
    assert kitchen.KITCHEN.install_hint == f"pip install 'comfy-kitchen>={kitchen.KITCHEN.min_version}'"


def test_the_installed_comfy_kitchen_takes_the_packs_calls():
    """Whatever comfy-kitchen this environment has (CI: 0.2.40, and the floor, 0.2.36, in the floor phase): at least
    the floor, and its two calls take the keywords the pack passes (the CPU call above runs its eager Sol-Attn)."""
    import importlib.metadata
    import inspect
    from dispatcher.versions import at_least
    ck = pytest.importorskip("comfy_kitchen")
    assert at_least(importlib.metadata.version("comfy-kitchen"), kitchen.KITCHEN.min_version)
    assert {"scale", "attn_mask"} <= set(inspect.signature(ck.int8_attention).parameters)
    assert {"tau", "scale"} <= set(inspect.signature(ck.sol_attn).parameters)
    assert callable(ck.int8_attention_is_available) and callable(ck.sol_attn_is_available)
