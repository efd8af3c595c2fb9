"""Which backends compete for a signature under `auto`, and why each other one is left out."""

from __future__ import annotations

from .. import hub, registry, support
from ..inputs import AttentionInputs


def candidates(inputs: AttentionInputs, *, exact: bool = False, attention_kwargs=(), model: str | None = None,
               block: str | None = None, among: tuple[str, ...] | None = None
               ) -> tuple[list[str], list[tuple[str, list[str]]], bool]:
    """(names in priority order, [(skipped name, reasons)], trust-sensitive): every backend (of `among`, when given)
    that `support.for_auto` finds nothing against (the decision's own reasons for these inputs and attention_kwargs
    keys, then auto's rules: exact kernels only for auto_exact, Hub kernels only once fetched, approximate ones as
    the model's prediction-level verdict allows at `block`), less those that are a last resort here
    (`last_resorts`)."""
    names, skipped, sensitive = [], [], False
    fetched = None
    for name in registry.names():  # the priority order
        if among is not None and name not in among:
            continue
        try:
            if fetched is None and registry.get(name).hub is not None:
                fetched = hub.fetched_repos()
            why = support.for_auto(name, inputs, exact_only=exact, attention_kwargs=attention_kwargs,
                                   fetched=fetched or frozenset(), model=model, block=block)
            sensitive = sensitive or support.trust_decides(name, why, exact_only=exact)
        except registry.UnknownBackendError:  # removed by another thread
            continue
        if why.runs:
            names.append(name)
        else:
            skipped.append((name, why.reasons))
    last = last_resorts(names, inputs)
    return [n for n in names if n not in last], skipped + list(last.items()), sensitive


def last_resorts(names: list[str], inputs: AttentionInputs) -> dict[str, list[str]]:
    """{name: [reason]} of the candidates `names` that their spec's `auto_last_resort` leaves out on this device,
    where another candidate can run the call (a kernel that cannot win there is not worth its first call)."""
    kind = inputs.device_kind
    last = {}
    for name in names:
        rule = registry.get(name).auto_last_resort
        if rule is not None and kind in rule.devices:
            last[name] = [rule.reason]
    return last if len(last) < len(names) else {}
