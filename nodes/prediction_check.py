"""The prediction-level verdict on approximate kernels (dispatcher/prediction.py) in ComfyUI: an APPLY_MODEL wrapper
that, at the first model call inside the node's step window while the verdict is due, runs the denoiser twice on
the same input (approximate kernels refused, then allowed) and returns the prediction the verdict keeps. The node's
recorder counts what the trial's calls were served by: a trial no approximate kernel served decides nothing, and
the next model call tries again (at most prediction.MAX_TRIALS).

Only Set Attention Backend with `auto_fast` installs it, and only a machine that can run an approximate kernel
(sol_attn) pays the second forward, once per model. Each forward gets its own copy of transformer_options that the
override's block ordinals read as a forward of its own (nodes/comfy_versions.py `new_forward`), so the second
forward's calls get the same block names as the first's.
"""

from __future__ import annotations

from ..dispatcher import prediction, prediction_trial
from .comfy_versions import new_forward
from .window import in_window

_OPTIONS_AT = 5  # apply_model(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)


def _options(args: tuple, kwargs: dict) -> dict:
    found = args[_OPTIONS_AT] if len(args) > _OPTIONS_AT else kwargs.get("transformer_options")
    return found if isinstance(found, dict) else {}


def _with_options(args: tuple, kwargs: dict, options: dict) -> tuple[tuple, dict]:
    if len(args) > _OPTIONS_AT:
        return args[:_OPTIONS_AT] + (options,) + args[_OPTIONS_AT + 1:], kwargs
    return args, {**kwargs, "transformer_options": options}


def apply_model_wrapper(model: str, window, recorder=None):
    """WrappersMP.APPLY_MODEL for a model served by `auto_fast` (model: its identity, the dispatcher's model scope;
    recorder: the one its attention calls record into, the node's)."""
    def wrapper(executor, *args, **kwargs):
        options = _options(args, kwargs)
        if not prediction.due(model) or not in_window(options, window) \
                or not prediction_trial.available_here():
            return executor(*args, **kwargs)

        def forward():
            call_args, call_kwargs = _with_options(args, kwargs, new_forward(options))
            return executor(*call_args, **call_kwargs)
        return prediction_trial.judge(model, forward, forward, recorder=recorder)[1]
    return wrapper


def require(patched, model: str, window, key: str, recorder) -> None:
    """Ask for `model`'s verdict and install the wrapper that makes it on the clone `patched` (under wrapper `key`;
    recorder: the one the override records `model`'s calls into)."""
    import comfy.patcher_extension  # ComfyUI's own module, imported only when a node runs
    prediction.require(model)
    patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, key,
                                 apply_model_wrapper(model, window, recorder))


def report(model: str) -> dict:
    """What the node's report and badge say of the verdict: {} when none was made for this model."""
    verdict = prediction.verdict(model)
    if verdict is None:
        if prediction.status(model) == prediction.PENDING and prediction_trial.available_here():
            return {"notes": ["sparse: no verdict yet (no model call inside the step window): approximate kernels "
                              "did not serve"]}
        return {}
    return {"sparse_verdict": verdict.as_dict(), "notes": [verdict.text]}
