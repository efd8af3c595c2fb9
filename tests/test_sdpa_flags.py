"""The SDPA flag switch behind the pinned `_native_*` backends and `native`'s GPU priority.

torch's own `sdpa_kernel` costs ~37 us a call; `_select` flips the same process-wide flags directly.
It must pin exactly what it is asked, restore everything afterwards (errors included), and stay
consistent when several threads switch at once.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.nn.attention import SDPBackend

from dispatcher.backends.native import CUDA_PRIORITY, _select


def sdpa_state():
    return (tuple(torch._C._get_sdp_priority_order()), torch._C._get_flash_sdp_enabled(),
            torch._C._get_mem_efficient_sdp_enabled(), torch._C._get_math_sdp_enabled(),
            torch._C._get_cudnn_sdp_enabled())


def enabled():
    return {SDPBackend.FLASH_ATTENTION: torch._C._get_flash_sdp_enabled(),
            SDPBackend.EFFICIENT_ATTENTION: torch._C._get_mem_efficient_sdp_enabled(),
            SDPBackend.MATH: torch._C._get_math_sdp_enabled(),
            SDPBackend.CUDNN_ATTENTION: torch._C._get_cudnn_sdp_enabled()}


@pytest.mark.parametrize("pinned", [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION])
def test_pinning_enables_only_that_kernel_and_restores(pinned):
    before = sdpa_state()
    inside = _select((pinned,), False, enabled)
    assert inside == {b: b == pinned for b in inside}
    assert sdpa_state() == before


def test_priority_puts_the_list_first_and_restores():
    before = sdpa_state()
    order = _select(CUDA_PRIORITY, True, torch._C._get_sdp_priority_order)
    assert order[:4] == [int(b) for b in CUDA_PRIORITY] and sorted(order) == sorted(before[0])
    assert _select(CUDA_PRIORITY, True, enabled) == enabled()  # priority mode leaves the user's flags alone
    assert sdpa_state() == before


def test_state_is_restored_when_the_call_raises():
    before = sdpa_state()
    for priority, backends in ((False, (SDPBackend.MATH,)), (True, CUDA_PRIORITY)):
        with pytest.raises(ZeroDivisionError):
            _select(backends, priority, lambda: 1 / 0)
        assert sdpa_state() == before


def test_threads_switching_at_once_each_see_their_pin_and_leave_the_defaults():
    before = sdpa_state()
    pins = [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    wrong, errors = [], []

    def worker(pin):
        try:
            for _ in range(300):
                seen = _select((pin,), False, enabled)
                if seen != {b: b == pin for b in seen}:
                    wrong.append((pin, seen))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(pin,)) for pin in pins * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not wrong
    assert sdpa_state() == before
