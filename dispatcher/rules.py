"""A caller's own rules of which kernels may serve it, on top of what the machine and the call allow: one frozen
`Rules` value. What each rule refuses, and in which words, is support.py's (`why_not(..., rules=...)`); which of them
one call may carry to the entry (`dispatch_attention_fn(..., rules=...)`: those that keep it exact) is said here.
Not the quality guard's `GuardRules` (which checks watch the kernel that serves).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Rules:
    """A caller's own rules on top of what the machine and the call allow; each refuses in `why_not` (as `rules`
    reasons), in one set of words for every caller. The default refuses nothing. (Not the fallback policy, the
    string 'fallback' | 'strict': that says what happens after a refusal, these say what is refused.)"""
    exact_only: bool = False  # auto_exact: exact kernels only
    low_precision: bool = True  # False: the call asks for full precision (ComfyUI's low_precision_attention=False)
    fetched: frozenset[str] | None = None  # Hub kernels only once their repo is here (auto never downloads); None: any
    model: str | None = None  # an approximate kernel serves this model only as its prediction-level verdict allows
    block: str | None = None  # ... at this call site (a verdict admits the blocks its trial judged)
    memory_cap: int | None = None  # bytes: a kernel that materialises the score matrix only where it fits (needs inputs)
    context_parallel: str | None = None  # the context-parallel mode it would be the local kernel of


NO_RULES = Rules()
# What a single call may carry to the entry (`dispatch_attention_fn(..., rules=...)`): the rules that keep it exact.
# The others are `auto`'s and the tools' (a fetched kernel, a model's verdict, a memory cap, a context-parallel mode).
CALL_RULES = ("exact_only", "low_precision")
_OTHER_RULES = tuple(f.name for f in fields(Rules) if f.name not in CALL_RULES)


def other_rules(rules: Rules) -> list[str]:
    """The rules `rules` sets that a call does not take (not in `CALL_RULES`). Plain attribute reads: the traced
    route asks it inside torch.compile."""
    return [name for name in _OTHER_RULES if getattr(rules, name) != getattr(NO_RULES, name)]


def call_rules(rules) -> Rules | None:
    """`rules` as a call carries them: None for none (or the default, which refuses nothing); a clear error for
    anything but a `Rules` value, or one that sets more than the rules a call takes (`CALL_RULES`)."""
    if rules is None or rules == NO_RULES:
        return None
    if not isinstance(rules, Rules):
        raise TypeError(f"rules must be a dispatcher.Rules value or None; got {type(rules).__name__}")
    others = other_rules(rules)
    if others:
        raise ValueError(f"a call's rules keep it exact ({', '.join(CALL_RULES)}); {', '.join(others)} "
                         "are rules of auto's candidates and the tools, not of one call: leave them out here")
    return rules
