"""Which transformer block an attention call comes from, and whether a Set Attention Backend's block range covers it.

Why from transformer_options: it is the only block position the attention override sees. What ComfyUI puts there:
- newer ComfyUI DiTs (Flux, WAN, Chroma, Lumina, ...): `block_index` with `total_blocks`. Flux-style models number
  each kind of block from 0 (double blocks 0..18, then single blocks 0..37), so a range applies to each kind.
- the SD/SDXL UNet (ComfyUI 0.3.64 and later): `transformer_index`, the running number of the spatial transformer
  (its `block_index` is the index inside one transformer, so it is not used there). There is no block count, so a
  negative bound other than block_end = -1 ("to the last block") cannot resolve.
- ComfyUI 0.3.64's WAN and Flux: nothing. The range then cannot apply and every block uses the backend.

The same options name the block in call sites ("self #5", `block_name`); where they say nothing, the call's
ordinal within the forward does (`Ordinals`).

The range is inclusive, negative bounds count from the end (-1 = the last block); (0, -1) = every block, the default,
which the override never looks at (no per-call cost).
"""

from __future__ import annotations

DEFAULT_RANGE = (0, -1)
RANGE_RULE = ("the block range needs block_start <= block_end when both count from the same end "
              "(negative = from the last block: -1 is the last)")
NO_POSITION = ("this model tells attention no block position (ComfyUI 0.3.64's WAN and Flux do not; newer ComfyUI "
               "does): the block range cannot apply")
NO_COUNT = ("this model tells attention its block position but not the number of blocks (the SD/SDXL UNet): a "
            "negative block_start, or a block_end below -1, cannot resolve, so the block range cannot apply; "
            "count from 0 instead")


def block_name(transformer_options: dict, ordinals: "Ordinals | None", is_self: bool) -> str | None:
    """The block a call comes from, as its call site names it ("#5"; the UNet's "#4.1" = spatial transformer 4,
    its block 1): the position ComfyUI passes, else the call's ordinal within this forward among calls of its kind
    (`Ordinals`; ordinals None: no counting, inside a torch.compile trace); None without transformer_options
    (nothing tells one forward from the next)."""
    to = transformer_options
    if not to:
        return None
    index = to.get("block_index")
    if type(index) is int and type(to.get("total_blocks")) is int:
        return _number(index)
    unet = to.get("transformer_index")
    if type(unet) is int:
        return f"#{unet}.{index}" if type(index) is int else _number(unet)
    if ordinals is None:
        return None
    n = ordinals.next(to, (to.get("block_type"), is_self))
    return _number(n) if n < MAX_ORDINAL else None


# Past this many calls of one kind in one "forward", the options that mark forwards are not new for each one (a
# caller that keeps one dict): the calls are no longer numbered (a plan and a verdict per call would pile up).
MAX_ORDINAL = 1024
_NUMBERS = tuple(f"#{n}" for n in range(256))  # made once: most calls' block names cost no formatting


def _number(n: int) -> str:
    return _NUMBERS[n] if 0 <= n < 256 else f"#{n}"


class Ordinals:
    """The ordinal of a call within one model forward, per kind of call (self or cross, block type), for models
    that pass no block position (ComfyUI 0.3.64's WAN and Flux): the Nth self-attention call of a forward is
    block N's. A forward is told from the next by its `cond_or_uncond` list, which ComfyUI makes anew for each
    batch it runs (cond and uncond batched together: one forward; run one after the other: two, each counted
    from 0) and which copies of the options share; without it, by the options dict itself. Both are held (not
    their ids), so a freed one's address cannot come back as the same forward."""

    __slots__ = ("forward", "counts")

    def __init__(self):
        self.forward = None
        self.counts: dict = {}

    def next(self, to: dict, kind) -> int:
        forward = to.get("cond_or_uncond", to)
        if forward is not self.forward:
            self.forward, self.counts = forward, {}
        n = self.counts.get(kind, 0)
        self.counts[kind] = n + 1
        return n


def is_default(start: int, end: int) -> bool:
    return (start, end) == DEFAULT_RANGE


def blocks_text(blocks: tuple[int, int]) -> str:
    return f"{blocks[0]}..{blocks[1]}"


def block_position(transformer_options: dict | None) -> tuple[int, int | None] | None:
    """(index, total or None) of the block making this call; None when the options do not say."""
    to = transformer_options or {}
    index, total = to.get("block_index"), to.get("total_blocks")
    if type(index) is int and type(total) is int and total > 0:
        return index, total
    index = to.get("transformer_index")
    if type(index) is int:
        return index, None
    return None


def in_blocks(transformer_options: dict | None, blocks: tuple[int, int]):
    """True inside the range, False outside, or a str saying why the range cannot apply to this call (the call
    then uses the backend, as if the range were the default)."""
    position = block_position(transformer_options)
    if position is None:
        return NO_POSITION
    index, total = position
    start, end = blocks
    if total is None:
        if start < 0 or end < -1:
            return NO_COUNT
        return start <= index and (end == -1 or index <= end)
    if start < 0:
        start += total
    if end < 0:
        end += total
    return start <= index <= end


def range_problem(start, end) -> str | None:
    """Queue time: why (start, end) selects no block in any model, or None. Bounds of different signs depend on the
    model's block count and are judged when it runs."""
    if (start >= 0) == (end >= 0) and start > end:
        return f"block_start {start} is after block_end {end} ({RANGE_RULE})"
    return None
