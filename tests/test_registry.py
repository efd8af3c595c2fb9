"""The registry: every built-in spec, availability on real and simulated machines, per-call reasons."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types

import pytest
import torch

from dispatcher import (BUILTIN_NAMES, BackendUnavailableError, Machine, UnknownBackendError, attention_backend,
                        availability_reasons, backend_names, get_backend_spec, list_backends, register_backend,
                        unregister_backend, use_machine)
from dispatcher import registry
from dispatcher.requirements import Package
from dispatcher.inputs import describe_call

CPU_AVAILABLE = {"native", "_native_math", "_native_flash", "flex"}
TORCH = "2.13.0"


def cuda_machine(capability=(9, 0), name="NVIDIA H200", **packages) -> Machine:
    return Machine(torch_version=TORCH, device_type="cuda", device_name=name, cuda_capability=capability,
                   cuda_version="12.8", packages={"torch": TORCH, **packages}, simulated=True)


def rocm_machine(arch: str, **packages) -> Machine:
    return Machine(torch_version=TORCH, device_type="rocm", device_name=f"AMD {arch}", rocm_arch=arch,
                   hip_version="6.3", packages={"torch": TORCH, **packages}, simulated=True)


H200 = cuda_machine()


def statuses(machine=None) -> dict:
    return {s.name: s for s in list_backends(machine)}


def call_inputs(*, b=1, lq=16, lk=16, h=2, d=64, dtype=torch.float16, mask=None, device="cuda", **flags):
    """An AttentionInputs for a call on `device` (the tensors stay on the CPU; only the description moves)."""
    q = torch.zeros(b, lq, h, d, dtype=dtype)
    k = torch.zeros(b, lk, h, d, dtype=dtype)
    inputs = describe_call(q, k, k, mask, flags.get("dropout_p", 0.0), flags.get("is_causal", False),
                           flags.get("scale"), flags.get("enable_gqa", False), flags.get("return_lse", False), "BSHD")
    dev = torch.device(device)
    return dataclasses.replace(inputs, device=dev, key_device=dev, value_device=dev)


def reasons_for(name, inputs, machine=H200):
    with use_machine(machine):
        return get_backend_spec(name).not_supported_reasons(inputs)


# --- the built-in specs -------------------------------------------------------------------------

def test_every_builtin_name_is_registered_in_order():
    """Counted from the registry, never a literal: adding a backend touches its family file and nothing else."""
    from dispatcher.backends import PRIORITY
    declared = [n for n in backend_names() if not get_backend_spec(n).custom]  # the registry, now
    assert list(registry.builtin_names()) == declared and len(set(declared)) == len(declared)
    assert list(BUILTIN_NAMES) == declared  # the public tuple is the registry's, not a list of its own
    assert backend_names()[:len(declared)] == declared
    assert set(PRIORITY) <= set(declared), "PRIORITY names a backend no family file declares"
    for name in declared:  # each declared in its family file under dispatcher/backends/
        module = get_backend_spec(name).fn.__module__
        assert module.startswith("dispatcher.backends."), (name, module)
    try:  # every diffusers backend has ours (test_diffusers_parity.py checks where they point)
        from diffusers.models.attention_dispatch import AttentionBackendName
    except ImportError:
        return
    assert {member.value for member in AttentionBackendName} <= set(BUILTIN_NAMES)


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_builtin_spec_describes_itself(name):
    spec = get_backend_spec(name)
    assert spec.name == name and not spec.custom
    c = spec.constraints()
    assert isinstance(c["family"], str) and c["family"]
    assert isinstance(c["description"], str) and len(c["description"]) > 10
    assert c["layout"] in ("BSHD", "BHSD")
    assert c["dtypes"] and all(d in ("float16", "bfloat16", "float32", "float64") for d in c["dtypes"])
    assert isinstance(c["head_dims"], str) and c["head_dims"]
    assert c["devices"] and isinstance(c["requires"], list)
    assert all(isinstance(r, str) and r for r in c["requires"])
    assert set(c["supports"]) == {"mask", "causal", "mask_with_causal", "scale", "gqa", "dropout", "lse", "backward",
                                 "broadcast_kv", "attention_kwargs"}
    assert all(m in ("bool", "key_padding", "additive", "blockmask") for m in c["supports"]["mask"])
    # Every chain ends in something that runs anything SDPA accepts.
    assert all(f in BUILTIN_NAMES for f in c["fallback"])


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_builtin_runner_takes_the_standard_arguments_by_position(name):
    """The dispatcher passes a built-in runner the nine standard arguments by position (registry.prepare's
    protocol; only custom backends get keywords). A wrapper that takes `(q, k, v, **kwargs)` breaks every call of
    its family, and only on a GPU with that family installed: checked here for all of them."""
    spec = get_backend_spec(name)
    fn = functools.partial(spec.fn, kernel=object()) if spec.hub is not None else spec.fn  # as prepare() makes it
    inspect.signature(fn).bind(*range(9))


def test_named_sage_kernels_run_through_the_dispatchers_call_protocol(monkeypatch):
    """Each named SageAttention function, called as the dispatcher calls it (positional standard arguments),
    gets (B, S, H, D) tensors with tensor_layout='NHD', the scale as sm_scale and return_lse; here a stand-in
    `sageattention` module (SDPA underneath) records the calls, as the GPU tests run the real one."""
    from dispatcher import registry
    seen = []

    def kernel(function):
        def run(q, k, v, *, tensor_layout, is_causal, sm_scale=None, return_lse=False, qk_quant_gran="per_thread"):
            seen.append((function, tensor_layout, sm_scale, return_lse, qk_quant_gran))
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=is_causal, scale=sm_scale)
            lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
            return (out.transpose(1, 2), lse) if return_lse else out.transpose(1, 2)
        return run

    names = {"sage": "sageattn", "_sage_qk_int8_pv_fp8_cuda": "sageattn_qk_int8_pv_fp8_cuda",
             "_sage_qk_int8_pv_fp8_cuda_sm90": "sageattn_qk_int8_pv_fp8_cuda_sm90",
             "_sage_qk_int8_pv_fp16_cuda": "sageattn_qk_int8_pv_fp16_cuda",
             "_sage_qk_int8_pv_fp16_triton": "sageattn_qk_int8_pv_fp16_triton",
             "sage_sm90_per_warp": "sageattn_qk_int8_pv_fp8_cuda_sm90"}
    module = types.ModuleType("sageattention")
    for function in names.values():
        setattr(module, function, kernel(function))
    monkeypatch.setitem(sys.modules, "sageattention", module)
    q, k, v = (torch.randn(1, 16, 2, 64) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.1).transpose(1, 2)
    for name, function in names.items():
        runner = registry.prepare(name)
        torch.testing.assert_close(runner(q, k, v, None, 0.0, False, 0.1, False, False), expected)
        granularity = "per_warp" if name == "sage_sm90_per_warp" else "per_thread"  # the kernel's own default
        assert seen[-1] == (function, "NHD", 0.1, False, granularity)
        if get_backend_spec(name).lse:
            out, lse = runner(q, k, v, None, 0.0, False, 0.1, False, True)
            assert lse.shape == (1, 16, 2) and seen[-1][3] is True


def test_hub_backends_name_their_repository():
    for name in BUILTIN_NAMES:
        spec = get_backend_spec(name)
        assert (spec.hub is not None) == name.endswith("_hub"), name
        if spec.hub is not None:
            c = spec.constraints()
            assert c["hub"]["repo_id"] == spec.hub.repo_id and "/" in spec.hub.repo_id
            assert any(r.startswith("kernels>=") for r in c["requires"]), name


# --- availability ---------------------------------------------------------------------------------

def test_list_backends_on_this_cpu_machine():
    found = statuses()
    assert list(found) == backend_names()
    for name, status in found.items():
        assert status.available == (not status.reasons)
        if not status.available:
            assert all(isinstance(r, str) and len(r) > 10 for r in status.reasons), name
        assert status.as_dict()["name"] == name and "supports" in status.as_dict()
    if not torch.cuda.is_available():
        assert {n for n, s in found.items() if s.available} == CPU_AVAILABLE
        assert "needs an NVIDIA CUDA GPU" in " ".join(found["_native_cudnn"].reasons)


def test_simulated_h200_without_packages():
    found = statuses(H200)
    for name in ("_native_cudnn", "_native_efficient", "_native_flash", "native", "_native_math", "flex"):
        assert found[name].available, (name, found[name].reasons)
    assert not found["flash"].available
    assert any("pip install" in r for r in found["flash"].reasons), found["flash"].reasons
    assert not any("GPU" in r for r in found["flash"].reasons)  # the GPU is fine; only the package is missing
    # Hub backends need the kernels library; sage needs its package.
    assert any("kernels is not installed" in r for r in found["flash_hub"].reasons)
    assert any("sageattention" in r for r in found["sage"].reasons)


def test_simulated_h200_with_old_and_new_flash_attn():
    old = statuses(H200.with_packages(flash_attn="2.5.0"))["flash"]
    assert not old.available
    assert any("older than the required 2.6.3" in r for r in old.reasons), old.reasons
    assert any("2.5.0" in r for r in old.reasons)
    new = statuses(H200.with_packages(flash_attn="2.7.4"))
    assert new["flash"].available and new["flash_varlen"].available


def test_flash3_from_either_provider():
    """FlashAttention-3 comes from a source build or the forward-only fa3-fwd wheel: either makes _flash_3
    available; neither names both fixes; the wheel needs torch's stable ABI of 2.10."""
    neither = statuses(H200)["_flash_3"]
    assert not neither.available
    assert any("flash-attn-3 is not installed" in r and "pip install fa3-fwd" in r for r in neither.reasons)
    for packages in ({"flash_attn_3": "3.0.0b1"}, {"fa3_fwd": "0.0.3"}):
        assert statuses(H200.with_packages(**packages))["_flash_3"].available, packages
    old_torch = dataclasses.replace(H200.with_packages(fa3_fwd="0.0.3"), torch_version="2.9.1")
    assert any("fa3-fwd needs torch>=2.10" in r for r in statuses(old_torch)["_flash_3"].reasons)


def test_every_package_a_backend_needs_is_looked_up():
    """The machine's description tracks every distribution a registered backend names, derived from the specs:
    a new backend's package (even a custom one's) is looked up without touching machine.py."""
    from dispatcher.machine import tracked_distributions
    from dispatcher.registry import get, names
    needed = {d for name in names() for req in get(name).requirements for d in getattr(req, "distributions", ())}
    assert {"fa3-fwd", "flash-attn-3", "sageattention", "kernels", "xformers"} <= needed
    assert needed <= set(tracked_distributions()), needed - set(tracked_distributions())
    register_backend("needs_a_new_package", lambda *a, **k: None,
                     requires=(Package("some-new-attention-package", "1.0"),))
    try:
        assert "some-new-attention-package" in tracked_distributions()
    finally:
        unregister_backend("needs_a_new_package")


def test_hub_backends_with_kernels_installed():
    found = statuses(H200.with_packages(kernels="0.17.2"))
    for name in ("flash_hub", "flash_varlen_hub", "_flash_3_hub", "_flash_3_varlen_hub", "flash_4_hub"):
        assert found[name].available, (name, found[name].reasons)
    assert not found["aiter_fa2_hub"].available  # ROCm only
    # FlashAttention-4 is built for Hopper/Blackwell; an A100 is refused by name.
    a100 = statuses(cuda_machine((8, 0), "NVIDIA A100", kernels="0.17.2"))
    assert not a100["flash_4_hub"].available and any("sm_80" in r for r in a100["flash_4_hub"].reasons)


def test_sm75_is_named_in_flash3_hub_reason():
    reasons = availability_reasons("_flash_3_hub", cuda_machine((7, 5), "Tesla T4", kernels="0.17.2"))
    assert reasons and any("sm_75" in r for r in reasons), reasons
    assert availability_reasons("_flash_3_hub", cuda_machine((9, 0), kernels="0.17.2")) == []


def test_availability_of_two_short_lived_machines_is_not_mixed_up():
    """Regression: availability was cached by id(machine), and CPython reuses the id of a freed machine."""
    answers = []
    for capability in ((9, 0), (7, 5), (9, 0), (7, 5)):
        answers.append(bool(availability_reasons("_flash_3_hub", cuda_machine(capability, kernels="0.17.2"))))
    assert answers == [False, True, False, True]


def test_rocm_archs():
    gfx942 = statuses(rocm_machine("gfx942", kernels="0.17.2"))
    assert gfx942["aiter_fa2_hub"].available, gfx942["aiter_fa2_hub"].reasons
    assert gfx942["_native_efficient"].available
    assert not gfx942["_native_cudnn"].available and not gfx942["flash_hub"].available
    gfx1100 = statuses(rocm_machine("gfx1100", kernels="0.17.2"))["aiter_fa2_hub"]
    assert not gfx1100.available
    assert any("gfx1100" in r and "gfx942" in r for r in gfx1100.reasons), gfx1100.reasons
    # Without the kernels library the reason says how to install it.
    assert any("pip install" in r for r in statuses(rocm_machine("gfx942"))["aiter_fa2_hub"].reasons)


def test_sage_hub_needs_an_opt_in(monkeypatch):
    machine = H200.with_packages(kernels="0.17.2")
    reasons = availability_reasons("sage_hub", machine)
    assert any("DIFFUSERS_TRUST_REMOTE_KERNELS" in r for r in reasons), reasons
    monkeypatch.setenv("DIFFUSERS_TRUST_REMOTE_KERNELS", "true")
    assert availability_reasons("sage_hub", machine) == []


def test_old_torch_is_named():
    old = Machine(torch_version="2.4.1", device_type="cpu", packages={"torch": "2.4.1"}, simulated=True)
    found = statuses(old)
    for name in ("native", "flex", "_native_math"):
        assert any("older than the required 2.5" in r for r in found[name].reasons), found[name].reasons


def test_use_machine_scopes_the_simulation():
    with use_machine(H200):
        assert availability_reasons("_native_cudnn") == []
    if not torch.cuda.is_available():
        assert availability_reasons("_native_cudnn") != []


# --- per-call reasons -----------------------------------------------------------------------------

def test_sage_rejects_head_dim_160():
    reasons = reasons_for("sage", call_inputs(d=160))
    assert len(reasons) == 1 and "head dim 160" in reasons[0]


def test_sage_rejects_float32():
    reasons = reasons_for("sage", call_inputs(dtype=torch.float32))
    assert len(reasons) == 1 and "float32" in reasons[0] and "float16" in reasons[0]


def test_sage_rejects_a_mask_because_it_would_drop_it():
    mask = torch.zeros(1, 1, 16, 16)
    reasons = reasons_for("sage", call_inputs(mask=mask))
    assert len(reasons) == 1 and "would drop it" in reasons[0]
    assert reasons_for("sage", call_inputs()) == []


def test_all_reasons_are_listed_at_once():
    mask = torch.zeros(1, 1, 16, 16, dtype=torch.float32)
    reasons = reasons_for("sage", call_inputs(d=160, dtype=torch.float32, mask=mask, dropout_p=0.1))
    text = "\n".join(reasons)
    assert len(reasons) == 4, reasons
    for part in ("float32", "head dim 160", "would drop it", "dropout"):
        assert part in text


def test_flash_rejects_an_additive_mask():
    reasons = reasons_for("flash", call_inputs(mask=torch.zeros(1, 1, 16, 16, dtype=torch.float16)))
    assert len(reasons) == 1 and "additive" in reasons[0]


def test_flash_varlen_takes_a_key_padding_mask_only():
    padding = torch.ones(1, 1, 1, 16, dtype=torch.bool)
    assert reasons_for("flash_varlen", call_inputs(mask=padding)) == []
    assert reasons_for("flash_varlen", call_inputs(mask=padding[:, 0])) == []  # (B, 1, Lk)
    additive = reasons_for("flash_varlen", call_inputs(mask=torch.zeros(1, 1, 1, 16, dtype=torch.float16)))
    assert len(additive) == 1 and "additive" in additive[0] and "key-padding" in additive[0]
    full = reasons_for("flash_varlen", call_inputs(mask=torch.ones(1, 1, 16, 16, dtype=torch.bool)))
    assert len(full) == 1 and "bool mask" in full[0]


def test_flash_rejects_cross_attention_causal_but_sdpa_does_not():
    inputs = call_inputs(lq=8, lk=16, is_causal=True)
    assert any("bottom-right" in r for r in reasons_for("flash", inputs))
    assert reasons_for("native", inputs) == []


def test_capability_reason_is_per_call_on_cuda_tensors():
    t4 = cuda_machine((7, 5), "Tesla T4")
    assert any("sm_75" in r for r in reasons_for("_native_cudnn", call_inputs(), t4))
    assert reasons_for("_native_cudnn", call_inputs()) == []


def test_cpu_tensors_are_refused_by_cuda_backends():
    reasons = reasons_for("flash", call_inputs(device="cpu"))
    assert any("device cpu is not supported" in r for r in reasons)


# --- names ------------------------------------------------------------------------------------------

def test_unknown_name_lists_valid_names_and_suggests_a_close_one():
    with pytest.raises(UnknownBackendError) as err:
        get_backend_spec("sagee")
    text = str(err.value)
    assert "Did you mean 'sage'?" in text
    assert all(name in text for name in BUILTIN_NAMES)


def test_attention_backend_with_an_unknown_name():
    with pytest.raises(UnknownBackendError, match="nope"):
        with attention_backend("nope"):
            pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="flash may be installed on a GPU machine")
def test_attention_backend_flash_on_this_cpu_machine_names_the_gpu_not_a_pip_command():
    """Installing flash-attn would not make it run on a CPU: the error names the GPU it needs, no install hint."""
    with pytest.raises(BackendUnavailableError) as err:
        with attention_backend("flash"):
            pass
    assert err.value.name == "flash"
    assert "needs an NVIDIA CUDA GPU" in str(err.value) and "pip install" not in str(err.value)
    assert err.value.reasons and "cannot run on this machine" in str(err.value)


def test_sage_1x_refuses_key_lengths_it_pads_badly():
    """Measured on the H200: sageattention 1.0.6 is off by 2.8e-1 at Lk=77 (SD1.5 text tokens)."""
    h200 = Machine(torch_version="2.11.0", device_type="cuda", cuda_capability=(9, 0), simulated=True,
                   packages={"torch": "2.11.0", "sageattention": "1.0.6"})
    spec = get_backend_spec("sage")

    def reasons(len_kv):
        q = torch.randn(1, 1024, 2, 64, dtype=torch.bfloat16)
        kv = torch.randn(1, len_kv, 2, 64, dtype=torch.bfloat16)
        return [r for r in spec.not_supported_reasons(describe_call(q, kv, kv, None, 0.0, False, None, False, False,
                                                                    "BSHD")) if "key length" in r]

    with use_machine(h200):
        assert reasons(77) and "multiple of 128" in reasons(77)[0]
        assert reasons(333) and reasons(1000)
        assert not reasons(4096) and not reasons(4095) and not reasons(32760)
    with use_machine(h200.with_packages(sageattention="2.2.0")):
        assert not reasons(77)
