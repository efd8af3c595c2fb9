"""Which transformer block an attention call comes from, and whether a Set Attention Backend's block range covers it.

Why from transformer_options: it is the only block position the attention override sees. What each ComfyUI version
and model puts there is read by nodes/comfy_versions.py (`block_position`, `Ordinals`): a DiT's block index and count
(Flux-style models number each kind of block from 0, double blocks 0..18 then single blocks 0..37, so a range applies
to each kind); the UNet's spatial transformer number, without a count (a negative bound other than block_end = -1,
"to the last block", cannot resolve); or nothing (ComfyUI 0.3.64's WAN and Flux: the range cannot apply, every block
uses the backend, and the call's ordinal within the forward names it).

The one position names the block (`block_id`) and places it in a block range (`in_blocks`), so a call is always
judged by the block it is named after. A call's block identity is one value, `BlockId`, made here (`block_id`); its
text ("double.self #5") is the call site the dispatcher, `auto_fast`'s verdicts on disk and the node's reports key
by, written by `BlockId.text`; a report reads a site's fields back by `named` (the value that wrote the text), never
by parsing it.

The range is inclusive, negative bounds count from the end (-1 = the last block); (0, -1) = every block, the default,
which the override never looks at (no per-call cost).
"""

from __future__ import annotations

from typing import NamedTuple

from .comfy_versions import Ordinals

DEFAULT_RANGE = (0, -1)
RANGE_RULE = ("the block range needs block_start <= block_end when both count from the same end "
              "(negative = from the last block: -1 is the last)")
NO_POSITION = ("this model tells attention no block position (ComfyUI 0.3.64's WAN and Flux do not; newer ComfyUI "
               "does): the block range cannot apply")
NO_COUNT = ("this model tells attention its block position but not the number of blocks (the SD/SDXL UNet): a "
            "negative block_start, or a block_end below -1, cannot resolve, so the block range cannot apply; "
            "count from 0 instead")


class BlockId(NamedTuple):
    """Which block of the model an attention call comes from, and what kind of call it is. The identity a verdict,
    a guard demotion and a report row are kept by; the model's block count is not part of it (`block_position`)."""
    kind: str  # "self" | "cross" (a call site written by a library caller: all of its text)
    stream: str | None = None  # the model's kind of block as it names it: Flux's "double"/"single", the UNet's "input"
    index: int | None = None  # the block's position (`block_position`), else the call's ordinal in the forward
    inner: int | None = None  # the UNet: the block inside spatial transformer `index` ("#4.1")

    @property
    def text(self) -> str:
        """The one serialisation: "self", "double.self #5", "input.cross #4.1" (the call site; `named` reads it)."""
        head = f"{self.stream}.{self.kind}" if self.stream else self.kind
        if self.index is None:
            return head
        return f"{head} {_number(self.index)}" if self.inner is None else f"{head} #{self.index}.{self.inner}"

    @property
    def unnumbered(self) -> "BlockId":
        """The kind of site without its block ("self #5" -> "self"): what reports fold blocks by."""
        return BlockId(self.kind, self.stream)

    @property
    def fields(self) -> dict:
        """The identity as a report carries it: {kind, stream, index, inner} (JSON)."""
        return self._asdict()


def named(site) -> BlockId:
    """The block call site `site` names: the `BlockId` whose text it is (one `block_id` made in this process), else,
    for a site no block was named by here (a library caller's), a kind of its own: `named(site).text == site`."""
    made = _NAMED.get(site)
    return made if made is not None else BlockId(str(site))


def _name(made: BlockId) -> BlockId:
    """Keep `made` (and its kind, what reports fold blocks by) findable by its text: `named`."""
    if len(_NAMED) > MAX_ORDINAL * 16:  # a runaway caller is not kept (its sites then read as kinds of their own)
        _NAMED.clear()
    _NAMED[made.text] = made
    if made.index is not None:
        kind = made.unnumbered
        _NAMED[kind.text] = kind
    return made


def _name_traced(kind, stream, index, inner) -> bool:
    """`_name` for a block named inside a torch.compile trace: run once per trace, eagerly (dynamo takes its result
    as a constant), so the trace neither reads nor guards on the names kept (a compiled model's calls run no Python
    here: the report knows its blocks by what the trace named)."""
    _name(BlockId(kind, stream, index, inner))
    return True


# What torch.compiler.assume_constant_result sets, without importing torch._dynamo with the pack.
_name_traced._dynamo_marked_constant = True


def block_id(transformer_options: dict | None, position, ordinals: "Ordinals | None", is_self: bool, *,
             compiling: bool) -> BlockId:
    """The block a call comes from, made once per call: its kind (self/cross, from the call's lengths), the model's
    block type, and `position` (`block_position` of the same options) or else the call's ordinal within this forward
    among calls of its kind (ordinals None: no counting, as inside a torch.compile trace). Without
    transformer_options no block (nothing tells one forward from the next). compiling: inside a torch.compile trace
    (the caller's own test, made once per call)."""
    to = transformer_options
    if not to:
        return _SELF if is_self else _CROSS
    block_type = stream = to.get("block_type")
    if stream is None:
        block = to.get("block")
        if type(block) in (tuple, list) and block:
            stream = block[0]  # SD/SDXL UNet: ("input", 1)
    if stream is not None and type(stream) is not str:
        stream = str(stream)
    if position is not None:
        index, _, inner = position
    elif ordinals is not None:
        index, inner = ordinals.next(to, (block_type, is_self)), None
        if index >= MAX_ORDINAL:
            index = None
    else:
        index = inner = None
    kind = "self" if is_self else "cross"
    if compiling:  # traced once per graph, and its ints can be symbols there (dynamo makes an int of the options
        # that changes between calls dynamic): a cache lookup would compare them symbolically, which raised
        # "BooleanAtom not allowed in this context" in ComfyUI's compiled WAN; int() specialises the graph on it
        index, inner = None if index is None else int(index), None if inner is None else int(inner)
        _name_traced(kind, stream, index, inner)
        return BlockId(kind, stream, index, inner)
    key = (is_self, stream, index, inner)
    made = _MADE.get(key)
    if made is None:
        if len(_MADE) > MAX_ORDINAL * 8:  # block types are few and indices bounded; a runaway caller is not kept
            _MADE.clear()
        made = _MADE[key] = _name(BlockId(kind, stream, index, inner))
    return made


_MADE: dict = {}  # (is self, stream, index, inner) -> BlockId: most calls' identity costs a lookup, not a construction
_NAMED: dict = {}  # text -> the BlockId that wrote it (`named`), made here or its kind
_SELF, _CROSS = BlockId("self"), BlockId("cross")
# Past this many calls of one kind in one "forward", the options that mark forwards are not new for each one (a
# caller that keeps one dict): the calls are no longer numbered (a plan and a verdict per call would pile up).
MAX_ORDINAL = 1024
_NUMBERS = tuple(f"#{n}" for n in range(256))  # made once: most blocks' texts cost no formatting


def _number(n: int) -> str:
    return _NUMBERS[n] if 0 <= n < 256 else f"#{n}"


def is_default(start: int, end: int) -> bool:
    return (start, end) == DEFAULT_RANGE


def blocks_text(blocks: tuple[int, int]) -> str:
    return f"{blocks[0]}..{blocks[1]}"


def in_blocks(position, blocks: tuple[int, int]):
    """True inside the range, False outside, or a str saying why the range cannot apply to this call (the call
    then uses the backend, as if the range were the default). position: comfy_versions.block_position of the
    call's options."""
    if position is None:
        return NO_POSITION
    index, total, _ = position
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
