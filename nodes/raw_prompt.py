"""The widget values of a prompt as the client sent them, for the queue-time checks of that request.

Why: ComfyUI converts a BOOLEAN input with bool() before `validate_inputs` sees it, in the prompt itself,
so the text "no" or "false" arrives as True. An on_prompt handler runs in the request's task just before
validation and keeps a copy of the raw inputs in a context variable; each request runs in a task of its
own, so a request sees only its own prompt. No ComfyUI import: routes.register installs the handler.
"""

from __future__ import annotations

import contextvars

_RAW: contextvars.ContextVar[dict | None] = contextvars.ContextVar("attention_dispatch_raw_prompt", default=None)


def remember(json_data):
    """The on_prompt handler: copy every node's inputs (shallow: widget values are JSON scalars)."""
    prompt = json_data.get("prompt") if isinstance(json_data, dict) else None
    raw = None
    if isinstance(prompt, dict):
        raw = {str(k): dict(node["inputs"]) for k, node in prompt.items()
               if isinstance(node, dict) and isinstance(node.get("inputs"), dict)}
    _RAW.set(raw)
    return json_data


def raw_value(node_id, name: str, converted):
    """What the client sent for input `name` of node `node_id`; `converted` when this request kept no copy."""
    raw = _RAW.get()
    inputs = raw.get(str(node_id)) if raw is not None and node_id is not None else None
    if not isinstance(inputs, dict) or name not in inputs:
        return converted
    value = inputs[name]
    if isinstance(value, dict) and "__value__" in value:  # ComfyUI's wrapper for list widget values
        value = value["__value__"]
    return value
