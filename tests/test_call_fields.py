"""AttentionCall's fields are named once (dispatcher/call.py); every positional use of a call follows from it.

The hot path unpacks a call once instead of reading nine attributes; this reads the package's source (ast) and
checks that every such unpacking, and every call built by position, names the fields in their order. The runtime
op that carries a call through torch.compile builds its argument list from the definition: checked by a round trip.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from dispatcher import compiled
from dispatcher.call import AttentionCall
from dispatcher.decisions import Candidate
from dispatcher.report import Recorder

ROOT = Path(__file__).resolve().parents[1]
# Where a call is handled: the library, the ComfyUI nodes, the measurement scripts, the installer's hook.
SOURCES = sorted(p for folder in ("dispatcher", "nodes", "bench") for p in (ROOT / folder).rglob("*.py")) + [
    ROOT / "__init__.py", ROOT / "install.py"]
# The named tuples unpacked on the hot path: their class name (as annotated) -> their fields.
TUPLES = {"AttentionCall": AttentionCall._fields, "Candidate": Candidate._fields}


def _annotated(function: ast.AST) -> dict[str, str]:
    """Parameters of `function` annotated with one of TUPLES' classes: name -> class name."""
    args = function.args
    return {a.arg: a.annotation.id for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)
            if isinstance(a.annotation, ast.Name) and a.annotation.id in TUPLES}


def _built(function: ast.AST) -> dict[str, str]:
    """Names `function` assigns an AttentionCall it builds (`AttentionCall(...)`, `new_call(AttentionCall, ...)`)."""
    names = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and _construction(node.value) is not None:
            names[node.targets[0].id] = "AttentionCall"
    return names


def _construction(node: ast.AST) -> list[ast.AST] | None:
    """The positional values of an AttentionCall built here, or None when `node` builds none. new_call (tuple.__new__)
    fills no defaults: a plain tuple given to it ends in a Starred marker when it is short, so the check says so."""
    if not isinstance(node, ast.Call):
        return None
    if isinstance(node.func, ast.Name) and node.func.id == "AttentionCall":
        return list(node.args)
    if isinstance(node.func, ast.Name) and node.func.id == "new_call" and node.args \
            and isinstance(node.args[0], ast.Name) and node.args[0].id == "AttentionCall":
        values = node.args[1]
        if isinstance(values, ast.Tuple):  # every field, or the call is short of one
            return list(values.elts) + [_SHORT] * (len(AttentionCall._fields) - len(values.elts))
        while isinstance(values, ast.BinOp):  # (query, key, value, attn_mask) + self._rest: the named prefix
            values = values.left
        return list(values.elts) if isinstance(values, ast.Tuple) else []
    return None


_SHORT = ast.Constant(value="<missing: new_call fills no defaults>")


def _positional_problem(values: list[ast.AST], fields: tuple[str, ...]) -> str | None:
    for position, value in enumerate(values):
        if isinstance(value, ast.Starred):  # the rest comes from a slice of the definition (PreparedAttention)
            return None
        if position >= len(fields):
            return f"{len(values)} values for {len(fields)} fields"
        if not (isinstance(value, ast.Name) and value.id == fields[position]):
            return (f"value {position} is `{ast.unparse(value)}`, not a variable named `{fields[position]}`: "
                    "pass it by keyword")
    return None


def _unpack_problem(target: ast.Tuple, fields: tuple[str, ...]) -> str | None:
    names = [e.id if isinstance(e, ast.Name) else ast.unparse(e) for e in target.elts]
    if len(names) != len(fields):
        return f"{len(names)} names for {len(fields)} fields"
    wrong = [f"`{n}` where the field is `{f}`" for n, f in zip(names, fields) if n not in (f, "_")]
    return "; ".join(wrong) or None


def problems(source: str, where: str, checked: list | None = None) -> list[str]:
    """Every positional use of an AttentionCall (or a Candidate) in `source` that does not follow its definition;
    checked: gets every unpacking looked at (where, line)."""
    found = []
    checked = [] if checked is None else checked
    tree = ast.parse(source)
    for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        held = {**_built(function), **_annotated(function)}
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in held:
                for target in node.targets:
                    if isinstance(target, ast.Tuple):
                        checked.append((where, node.lineno))
                        why = _unpack_problem(target, TUPLES[held[node.value.id]])
                        if why:
                            found.append(f"{where}:{node.lineno}: unpacks {node.value.id}: {why}")
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in held:
                found.append(f"{where}:{node.lineno}: indexes {node.value.id} by position "
                             f"(`{ast.unparse(node)}`): read its fields by name")
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Tuple) and len(t.elts) == len(AttentionCall._fields)
                                                for t in node.targets):
            # As many names as the call has fields, whatever the value is called: it is one
            checked.append((where, node.lineno))
            why = _unpack_problem(node.targets[0], AttentionCall._fields)
            if why:
                found.append(f"{where}:{node.lineno}: unpacks {len(AttentionCall._fields)} values: {why}")
        values = _construction(node)
        if values:
            why = _positional_problem(values, AttentionCall._fields)
            if why:
                found.append(f"{where}:{node.lineno}: builds an AttentionCall by position: {why}")
    return sorted(set(found))


def test_every_positional_use_of_a_call_follows_its_definition():
    found, checked = [], []
    for path in SOURCES:
        found += problems(path.read_text(), path.relative_to(ROOT).as_posix(), checked)
    assert not found, "\n".join(found)
    # The hot path's unpackings of a call (and execute.py's of its candidate) are among those checked.
    assert {"dispatcher/eager.py", "dispatcher/execute.py"} <= {where for where, _ in checked}
    assert sum(where == "dispatcher/execute.py" for where, _ in checked) >= 2


@pytest.mark.parametrize("snippet, expected", [
    ("def f(call: AttentionCall):\n    q, k, v, m, *_ = call\n", "unpacks call"),
    ("def f(call: AttentionCall):\n    " + ", ".join(AttentionCall._fields[:-3] + ("guard", "model", "rules"))
     + " = call\n", "`guard` where the field is `model`"),
    ("def f(c):\n    " + ", ".join(("_",) * (len(AttentionCall._fields) - 1) + ("quality_guard",)) + " = c\n",
     "`quality_guard` where"),
    ("def f(call: AttentionCall):\n    return g(*call[:9])\n", "indexes call by position"),
    ("def f(call: Candidate):\n    _, spec, runner, convert_mask, transpose, _ = call\n", "`convert_mask` where"),
    ("def f(q, k, v):\n    return AttentionCall(q, k, v)\n", "value 0 is `q`"),
    ("def f(query, key, value, mask):\n    return new_call(AttentionCall, (query, key, value, mask) + rest)\n",
     "value 3 is `mask`"),
    ("def f(query, key, value):\n    return new_call(AttentionCall, (query, key, value))\n", "value 3 is `'<missing"),
    ("def f(query, key, value):\n    call = AttentionCall(query=query, key=key, value=value)\n    return call[0]\n",
     "indexes call"),
])
def test_the_check_finds_a_use_that_does_not_follow(snippet, expected):
    found = problems(snippet, "snippet")
    assert any(expected in line for line in found), found


@pytest.mark.parametrize("snippet", [
    "def f(call: AttentionCall):\n    " + ", ".join(f if i % 3 else "_" for i, f in enumerate(AttentionCall._fields))
    + " = call\n",
    "def f(query, key, value, attn_mask, rest):\n    return AttentionCall(query, key, value, attn_mask, *rest)\n",
    "def f(q):\n    return AttentionCall(query=q, key=q, value=q, layout='BHSD')\n",
])
def test_the_check_accepts_uses_that_follow(snippet):
    assert problems(snippet, "snippet") == []


def test_the_runtime_ops_arguments_carry_every_field():
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    recorder = Recorder()
    call = AttentionCall(query=q, key=k, value=v, attn_mask=torch.ones(4, 4, dtype=torch.bool), dropout_p=0.0,
                         is_causal=True, scale=0.5, enable_gqa=False, backend="native", layout="BSHD",
                         policy="strict", return_lse=True, call_site="self #2", recorder=recorder, model="m",
                         guard=("all", 3))
    arguments = compiled._op_arguments(call)
    assert len(arguments) == len(compiled._OP_ARGUMENT_NAMES)
    assert compiled._call_of(arguments) == call
    bare = AttentionCall(q, k, v)
    assert compiled._call_of(compiled._op_arguments(bare)) == bare
    # The registered op takes exactly these arguments, in this order.
    schema = compiled._runtime_op()._opoverload._schema
    assert tuple(a.name for a in schema.arguments) == compiled._OP_ARGUMENT_NAMES
    assert [n for n in compiled._OP_ARGUMENT_NAMES if n in AttentionCall._fields] == \
        [f for f in AttentionCall._fields if f in compiled._OP_ARGUMENT_NAMES]


def test_the_runtime_op_runs_a_call_as_the_eager_path_does():
    q, k, v = (torch.randn(1, 6, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    recorder = Recorder()
    call = AttentionCall(query=q, key=k, value=v, is_causal=True, backend="_native_math", return_lse=True,
                         call_site="self #1", recorder=recorder)
    out, lse = compiled._as_op(call)
    expected_out, expected_lse = compiled.dispatch_eager(call._replace(recorder=None))
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=0)
    assert recorder.served_by("_native_math") == 1  # the recorder travelled by its serial
