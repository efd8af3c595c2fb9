"""Which calls the quality guard checks (dispatcher/guard_schedule.py): a named block one call in `every`; a site that
names no block, which several blocks share (a library caller without call_site), on a schedule that no number of
blocks aliases with. With a fixed period, `every` = 3 and 30 blocks on one site checked blocks 0, 3, 6, ... and never
block 7, which then spoiled every call from the step it turned bad. The sweep below checks the bound for 2 to 128
blocks (intervals 2 to 8, and larger ones); the scenario tests run it through `dispatch_attention_fn`."""

from __future__ import annotations

import pytest
import torch

import dispatcher
from dispatcher import Recorder, dispatch_attention_fn, guard_rules, guard_schedule, recording
from helpers.tensors import qkv, sdpa as exact


def checked_positions(schedule: guard_schedule.Schedule, calls: int) -> list[int]:
    """The site's calls the Watch checks under `schedule`: its first call, then the gaps in turn."""
    out, n, turn = [], 0, 0
    while n < calls:
        out.append(n)
        n += schedule.gaps[turn % len(schedule.gaps)]
        turn += 1
    return out


def longest_unchecked(schedule: guard_schedule.Schedule, blocks: int) -> int:
    """Over the schedule's whole period: the most consecutive calls of any one of `blocks` blocks taking turns on
    the site (block b's k-th call is the site's call b + k * blocks) that hold no checked call, plus one (the
    bound a block meets: within this many of its calls it is checked)."""
    period = sum(schedule.gaps)  # the schedule repeats every `period` calls of the site, so each block's every
    rounds = period + schedule.bound + 1  # `period` of its own calls: one period and a bound more covers all
    checked = torch.zeros(blocks * rounds, dtype=torch.bool)
    checked[torch.tensor(checked_positions(schedule, blocks * rounds))] = True
    per_block = checked.view(rounds, blocks).T  # [block, its k-th call]
    worst = 0
    for row in per_block:
        at = torch.nonzero(row).flatten().tolist()
        assert at, "a block never checked"
        worst = max(worst, at[0] + 1, *(b - a for a, b in zip(at, at[1:])))
    return worst


@pytest.mark.parametrize("every", [2, 3, 4, 5, 6, 7, 8, 12, 30, 64, 200])
def test_every_block_sharing_a_site_is_checked_within_the_bound_whatever_their_number(every):
    """For 2 to 128 blocks on one site each block is checked within `bound` of its own calls, and the site no more
    often than one call in `every` (the cost the interval was sized for); the bound is 3 to 5 times `every` for small
    intervals (about `every` itself from MIN_PRIME on, a prime stride)."""
    schedule = guard_schedule.shared(every)
    assert sum(schedule.gaps) / len(schedule.gaps) >= every  # never more checks than the interval pays for
    assert schedule.bound <= (5 * every if every < guard_schedule.MIN_PRIME else 1.1 * every)
    for blocks in range(2, 129):
        assert longest_unchecked(schedule, blocks) <= schedule.bound, blocks


def test_the_bound_is_reached_and_a_multiple_of_the_prime_is_the_documented_exception():
    """The bound is tight (some number of blocks meets it), and only a number of blocks that is a multiple of the
    schedule's prime (above MIN_PRIME) can alias with it: then blocks at positions outside the schedule are never
    checked."""
    schedule = guard_schedule.shared(3)
    assert max(longest_unchecked(schedule, blocks) for blocks in range(2, 129)) == schedule.bound
    assert schedule.prime > guard_schedule.MIN_PRIME
    with pytest.raises(AssertionError, match="never checked"):
        longest_unchecked(schedule, schedule.prime)


def test_a_fixed_period_is_what_aliased():
    """The schedule a named block gets (one call in `every`) is what the issue's runs met on a shared site: with 30
    blocks and every = 3, block 7 is never checked."""
    stride = guard_schedule.Schedule((3,), 3, 0)
    with pytest.raises(AssertionError, match="never checked"):
        longest_unchecked(stride, 30)
    assert longest_unchecked(guard_schedule.shared(3), 30) <= guard_schedule.shared(3).bound


def test_every_one_checks_every_call():
    assert guard_schedule.shared(1) == ((1,), 1, 0)


@pytest.mark.parametrize("every", [3, 4])
def test_the_watch_checks_a_shared_site_on_that_schedule(every, monkeypatch):
    """Through dispatch_attention_fn: the calls of the default site the guard compares are the schedule's."""
    compared = []
    real = guard_rules.Comparison.verdict
    monkeypatch.setattr(guard_rules.Comparison, "verdict",
                        lambda self, *args: compared.append(len(calls)) or real(self, *args))
    dispatcher.register_backend(f"t_sched_{every}", lambda q, k, v, **_: exact(q, k, v), devices=("cpu",),
                                quantised=True)
    q, k, v = qkv(1, 16, h=1, d=8)
    calls = []
    for _ in range(120):
        calls.append(dispatch_attention_fn(q, k, v, backend=f"t_sched_{every}", guard_every=every))
    assert compared == checked_positions(guard_schedule.shared(every), 120)  # call indices, from 0


BAD_BLOCK, BAD_FROM_STEP, STEPS = 7, 5, 20


@pytest.mark.parametrize("every, blocks", [(3, 30), (4, 30), (3, 31), (4, 31)])
def test_the_issues_runs_catch_block_7_within_the_bound(every, blocks):
    """The issue's runs on one shared site: a quantised kernel goes wrong on block 7's activations (outlier keys)
    from step 5 of 20. With a fixed period (every 3 or 4 over 30 blocks) block 7 was never checked and spoiled all
    15 of its calls; now it is caught within the schedule's bound of its calls (at most bound - 1 spoiled), on
    block 7 only, and the site is then served exactly."""
    name = f"t_issue_{every}_{blocks}"
    dispatcher.register_backend(name, _WrongOnOutliers(), devices=("cpu",), quantised=True)
    q, k, v = qkv(1, 24, h=1, d=8, seed=5)
    loud = k.clone()
    loud[..., 0] = 100.0
    rec = Recorder()
    spoiled = []
    with recording(rec), dispatcher.model_scope(name):
        for step in range(STEPS):
            for block in range(blocks):
                keys = loud if block == BAD_BLOCK and step >= BAD_FROM_STEP else k
                out = dispatch_attention_fn(q, keys, v, backend=name, guard_every=every)
                if not torch.allclose(out, exact(q, keys, v), atol=1e-4):
                    spoiled.append((step, block))
    bound = guard_schedule.shared(every).bound
    assert {b for _, b in spoiled} <= {BAD_BLOCK} and len(spoiled) <= bound - 1, spoiled
    (entry,) = rec.snapshot()["guard"]
    assert len(entry["failures"]) == 1 and entry["every"] == bound
    assert f"each block checked again within {bound} of its calls" in rec.summary()


class _WrongOnOutliers:
    """Exact attention, except on keys past 50 (the bad block's): there off by noise, as an int8 kernel is."""

    def __call__(self, q, k, v, **_):
        out = exact(q, k, v)
        return out + torch.randn_like(out) if k.abs().amax() > 50 else out
