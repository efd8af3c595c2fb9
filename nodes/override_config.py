"""What one attention override is made from: one frozen value, normalised once.

Why one value: a Set Attention Backend node makes an override from its widgets, and an Attention Checks node after
it rebuilds that override with checks on (`dataclasses.replace(override.config, checks=..., tally=...)`), so the
settings travel as this value and nothing copies them field by field. block_notes / precision_notes are dicts
shared with the node's report (and with overrides rebuilt from this one): the value is frozen, not hashable.
No ComfyUI import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .blocks import is_default


@dataclass(frozen=True, eq=False)
class OverrideConfig:
    """backend: a dispatcher backend name, "auto_exact", "auto_fast" ("auto") or "comfy default" (or "pass through":
    Attention Checks around another pack's override); policy: the fallback policy, "fallback" | "strict";
    recorder: a `Recorder` (shared across clones); window: (start_percent, end_percent) or None; trust: publishers
    allowed for Hub kernels; checks: None | "raise" | "warn"; compare: a `Comparison` or None; previous: the
    override that was installed before this one; model: the model's identity string (None: the dispatcher's active
    scope); guard: the quality guard's mode ("quantised" | "all" | "off"; None: the dispatcher's default) and
    guard_every; blocks: (block_start, block_end) or None (every block); block_notes: site -> why the block range
    cannot apply there; default_attention: a zero-argument callable returning the attention function for container
    calls passed on (they come without `func`; None: ComfyUI's default attention); precision_notes: (site, what kept
    it exact) -> calls with low_precision_attention=False; sparse: the backend's own options value (None: its
    declared default; ignored for a backend that declares none); tally: an Attention Checks node's CheckTally."""
    backend: str
    policy: str = "fallback"
    recorder: Any = None
    window: tuple | None = None
    trust: tuple = ()
    checks: str | None = None
    compare: Any = None
    previous: Any = None
    model: str | None = None
    guard: str | None = None
    guard_every: int | None = None
    blocks: tuple | None = None
    block_notes: dict = field(default_factory=dict)
    default_attention: Any = None
    precision_notes: dict = field(default_factory=dict)
    sparse: Any = None
    tally: Any = None

    def __post_init__(self):  # normalised here, so a value made by dataclasses.replace is normalised too
        fix = object.__setattr__  # frozen: set once, while the value is made
        if self.window is not None:
            fix(self, "window", tuple(self.window))
        fix(self, "trust", tuple(sorted(frozenset(self.trust or ()))))
        blocks = self.blocks
        fix(self, "blocks", None if blocks is None or is_default(*blocks) else (int(blocks[0]), int(blocks[1])))
        if self.block_notes is None:
            fix(self, "block_notes", {})
        if self.precision_notes is None:
            fix(self, "precision_notes", {})
