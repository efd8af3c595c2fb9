"""One attention call, described once at the entry point and carried unchanged to the kernel.

`AttentionCall` is immutable (a tuple): the eager path, the traced routes, context parallelism and the
backend runner all take it whole; a route that changes something (a shard, a layout) makes a new one with
`call._replace(...)`. Building it costs one tuple, so the hot path pays nothing for carrying it.

Its fields are named here and nowhere else: code reads them by name (`call.scale`). Where the hot path unpacks a
call once (eager.py, execute.py), or a call is built by position, the names are the fields' own, in their order
(tests/test_call_fields.py reads the source to check it); the runtime op that carries a call through
torch.compile builds its argument list from this definition (compiled.OP_SCHEMA).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class AttentionCall(NamedTuple):
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: Any = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False
    attention_kwargs: dict | None = None
    backend: str | None = None  # None: the active backend
    layout: str = "BSHD"
    policy: str | None = None  # None: the active policy
    return_lse: bool = False
    call_site: str = "attention"
    recorder: Any = None  # None: the active `recording()` block's
    model: str | None = None  # whose activations these are (accuracy verdicts are per model); None: the active scope
    guard: tuple | None = None  # (mode, every) of the quality guard; None: the active setting
    rules: Any = None  # support.Rules that keep the call exact (its precision rules: support.call_rules); None: none


# The fields a caller passes per call come first (the tensors and the mask): call[PER_CALL:] is the rest, fixed per
# call site (dispatch.PreparedAttention, eager.Lane).
PER_CALL = AttentionCall._fields.index("attn_mask") + 1

# tuple.__new__ directly: the generated __new__ costs a Python frame per call on the hot path.
new_call = tuple.__new__
