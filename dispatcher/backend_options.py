"""A backend's own options, declared by its spec (`BackendSpec.options`): sol_attn's tau, dense blocks and minimum
tokens. A host (the ComfyUI nodes) builds its inputs from `fields`, makes the value with `build`, and reads the
value only through the protocol below, so no host code names a backend or imports its module.

The value `build` makes is frozen and offers:
- `applied()`: a context manager around each call that hands the value to the kernel (the dispatcher's call has
  no field for it: a contextvar the backend's function reads, so the hot path and the fallback chain are unchanged);
- `dense_reason(tokens, block)`: why a call of `tokens` tokens in block `block` (None: unknown) is passed on to the
  host's own attention rather than served, or None;
- `as_dict()`: the value as plain data, for reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Option:
    """One option a backend takes: kind is float | int | string; minimum/maximum/step for numbers."""

    name: str
    kind: str
    default: Any
    tooltip: str = ""
    minimum: float | None = None
    maximum: float | None = None
    step: float | None = None


@dataclass(frozen=True)
class BackendOptions:
    """fields: what a host shows and checks (types, ranges); build(**values) -> (value, problems): the value made
    from the fields' values (None with every problem named by its field when they do not make one); default: the
    value a call runs with when the host gives none."""

    fields: tuple[Option, ...]
    build: Callable[..., tuple[Any, list[str]]]
    default: Any

    def owns(self, value) -> bool:
        """`value` was built by this declaration (a host ignores another backend's options)."""
        return type(value) is type(self.default)
