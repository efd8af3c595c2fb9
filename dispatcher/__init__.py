"""ComfyUI Attention Dispatch: one registry of attention backends, framework-agnostic (no ComfyUI import).

    from dispatcher import dispatch_attention_fn, attention_backend, list_backends
    with attention_backend("flex"):
        out = dispatch_attention_fn(q, k, v)          # (B, S, H, D)
"""

import torch as _torch

from .versions import TORCH_FLOOR as _TORCH_FLOOR, at_least as _at_least

if not _at_least(_torch.__version__, _TORCH_FLOOR):  # said plainly, not as the AttributeError an old torch gives
    raise ImportError(f"attention dispatch needs torch>={_TORCH_FLOOR}; this Python has torch {_torch.__version__}. "
                      "Update torch in this environment (for ComfyUI: its Python, the build for your GPU)")

from . import backends as _backends  # noqa: F401  (registers the built-in backends)
from . import auto  # noqa: F401  (registers auto_exact / auto_fast / auto: auto.tune / report / explain / clear_cache)
from . import events, guard  # noqa: F401  (what a recorder is told; the quality guard's modes and bounds)
from . import prediction, prediction_trial  # noqa: F401  (the prediction-level verdict on approximate kernels)
# Modules a host reads as a whole: value checks (NaN/Inf), the environment's switches, the one logger and its
# echo of untrusted text, the exact reference a host compares with.
from . import checks, env, log, reference  # noqa: F401
from .call import AttentionCall, CallSite, tensors_key
from .checks import AttentionInputError
from .decisions import BackendNotSupportedError, UnderRules, fallback_order
from .dispatch import PreparedAttention, dispatch_attention_fn, kept_exact
from .inputs import AttentionInputs
from .hub import KernelLoadError, LoadedKernel, loaded_kernels
from .machine import Machine, current_machine, detect, use_machine
from .masks import register_mask_format
from .registry import BackendUnavailableError, UnknownBackendError, is_variant, register_backend
from . import registry as _registry
from .registry import get as get_backend_spec
from .registry import names as backend_names
from .registry import remove as unregister_backend
from .events import RecorderProtocol
from .report import Recorder, recording, rotation_text
from .spec import BackendSpec, HeadDims, HubKernel
from .guard import AttentionQualityError
from .rules import Rules
from .support import BackendStatus, availability_reasons, installing_helps, list_backends
from .state import (active_backend, active_checks, active_guard, active_model, active_policy, attention_backend,
                    attention_checks, fallback_policy, model_scope, quality_guard, set_attention_backend, set_checks,
                    set_fallback_policy, set_quality_guard, validate_backend)
from .trust import TRUSTED_PUBLISHERS, trusted_publishers

BUILTIN_NAMES = _registry.builtin_names()  # in priority order

__all__ = [
    "AttentionCall", "CallSite", "AttentionInputError", "AttentionInputs", "AttentionQualityError", "active_guard",
    "active_model", "guard", "model_scope", "quality_guard", "set_quality_guard", "BUILTIN_NAMES",
    "BackendNotSupportedError", "BackendSpec", "BackendStatus", "BackendUnavailableError", "HeadDims", "HubKernel",
    "KernelLoadError", "LoadedKernel", "Machine", "PreparedAttention", "Recorder", "RecorderProtocol",
    "TRUSTED_PUBLISHERS", "UnknownBackendError", "active_backend", "active_checks", "active_policy", "attention_backend",
    "attention_checks", "availability_reasons", "backend_names", "current_machine", "detect", "dispatch_attention_fn",
    "fallback_order", "fallback_policy", "get_backend_spec", "list_backends", "loaded_kernels", "recording",
    "register_backend", "register_mask_format", "set_attention_backend", "set_checks", "set_fallback_policy",
    "tensors_key", "trusted_publishers", "auto", "events", "unregister_backend", "use_machine", "validate_backend",
    # a call kept exact, and what kept it (the ComfyUI override's low_precision_attention=False)
    "Rules", "UnderRules", "kept_exact",
    # what a host (the ComfyUI nodes) reads besides the entry
    "checks", "env", "log", "prediction", "prediction_trial", "reference", "installing_helps", "is_variant", "rotation_text",
]
