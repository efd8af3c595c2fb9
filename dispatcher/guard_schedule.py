"""Which calls of a call site the quality guard checks, for an interval of `every` calls (guard.Watch keeps the count).

A site named by its caller is one block ("self #5": the ComfyUI node names every block, a library caller passes
`call_site`): one call in `every` of it is checked, so it is checked again within `every` of its calls; the blocks'
first re-checks are staggered over the interval (`phase`).

A site that names no block (`SHARED_SITE`, the library default "attention") is usually several blocks taking turns:
P blocks of one signature, P unknown to the guard. A fixed period aliases with them: with `every` = 3 and 30 blocks
every check fell on blocks 0, 3, 6, ... and block 7 was never checked. No schedule that cannot tell the blocks apart
checks each of them within `every` of its calls for every P (at one check in `every` of the site, some P and some
block always go longer), so `shared` gives one with a proven bound for every P that is not a multiple of a prime
p > MIN_PRIME (every P up to MIN_PRIME, nearly all beyond), at one check in `every` of the site or fewer:

- the calls whose position modulo p is an `every`-th power residue (the subgroup H of index `every` of the integers
  modulo p, for a prime p = 1 mod `every`). Block b's calls sit at b + kP; multiplying by P^-1 maps them onto k,
  so the calls of block b that are checked are those of a coset of H, shifted. Every coset has the density
  1/`every` and its largest gap can be computed: the bound is the largest gap of any of the `every` cosets,
  whatever P and b. Of the first CANDIDATES such primes the one with the smallest bound is kept (bounds 6, 11, 14,
  18, 21, 33, 29 for `every` 2 to 8: 3 to 5 times `every`);
- or a prime stride q (the first prime from max(`every`, MIN_PRIME + 1)) where its bound, q itself, is smaller
  (always from MIN_PRIME on, often from about 27): q is coprime with P, so each block is checked exactly once in q
  of its calls.

tests/test_guard_schedule.py checks the bound for every P from 2 to 128.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from .inputs import DEFAULT_CALL_SITE

SHARED_SITE = DEFAULT_CALL_SITE  # "attention": the site of a caller that named no block
MIN_PRIME = 128  # the shared schedule's prime exceeds it: every number of blocks up to it is covered
CANDIDATES = 8  # primes p = 1 mod every tried for the shared schedule; the one with the smallest bound is kept


class Schedule(NamedTuple):
    """The gaps between checked calls of a site (cyclic), and the bound: any `bound` consecutive calls of any one
    block sharing the site include a checked one."""
    gaps: tuple[int, ...]
    bound: int
    prime: int  # p (shared schedules); 0 for a plain stride


def phase(n: int, every: int) -> int:
    """Where in [0, every) the n-th named block's checks fall: the golden-ratio sequence, so the blocks seen so far
    (their number is not known in advance) are spread evenly over the interval and each forward checks about
    blocks / every of them, never a burst of consecutive ones."""
    return int((n * 0.6180339887498949) % 1.0 * every)


@functools.lru_cache(maxsize=None)
def shared(every: int) -> Schedule:
    """The checked calls of a site that several blocks may share, one in about `every` (see the module's docstring)."""
    if every <= 1:
        return Schedule((1,), 1, 0)
    # a prime stride above MIN_PRIME: coprime with every number of blocks up to it (Bertrand: one below twice it)
    q = next(n for n in range(max(every, MIN_PRIME + 1), 2 * max(every, MIN_PRIME + 1)) if _is_prime(n))
    best = Schedule((q,), q, q)
    p = (MIN_PRIME // every + 1) * every + 1
    tried = 0
    while every < MIN_PRIME and tried < CANDIDATES:
        if _is_prime(p):
            tried += 1
            residues = _power_residues(p, every)
            bound = max(_largest_gap(coset, p) for coset in _cosets(residues, p, every))
            if bound < best.bound:
                ordered = sorted(residues)
                gaps = tuple(b - a for a, b in zip(ordered, ordered[1:])) + (ordered[0] + p - ordered[-1],)
                best = Schedule(gaps, bound, p)
        p += every
    return best


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def _primitive_root(p: int) -> int:
    factors, n, d = set(), p - 1, 2
    while d * d <= n:
        while n % d == 0:
            factors.add(d)
            n //= d
        d += 1
    if n > 1:
        factors.add(n)
    return next(g for g in range(2, p) if all(pow(g, (p - 1) // f, p) != 1 for f in factors))


def _power_residues(p: int, every: int) -> list[int]:
    """The `every`-th powers modulo p (p = 1 mod every): a subgroup of (p - 1) / every elements."""
    step = pow(_primitive_root(p), every, p)
    out, x = [], 1
    for _ in range((p - 1) // every):
        out.append(x)
        x = x * step % p
    return out


def _cosets(residues: list[int], p: int, every: int):
    g = _primitive_root(p)
    for c in range(every):
        m = pow(g, c, p)
        yield [m * r % p for r in residues]


def _largest_gap(positions: list[int], p: int) -> int:
    s = sorted(positions)
    return max([b - a for a, b in zip(s, s[1:])] + [s[0] + p - s[-1]])

