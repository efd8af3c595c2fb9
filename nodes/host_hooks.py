"""The dispatcher's hooks into ComfyUI, registered once when the pack loads: tuning shows progress text on the
node that runs it, ComfyUI's Cancel stops tuning, and the tuning cache lives in ComfyUI's user directory (each
ComfyUI keeps its own; ATTN_DISPATCH_TUNE_CACHE still overrides it). ComfyUI only: imports its modules."""

from __future__ import annotations

import os

from ..dispatcher import auto


def register(cancel: bool = True) -> None:
    """cancel=False under torchrun: there Cancel is a collective check the ranks make in lockstep (cp_runtime), and
    tuning takes a different number of steps on each rank, so it must not check on its own."""
    import comfy.model_management
    import folder_paths

    auto.set_default_dir(os.path.join(folder_paths.get_user_directory(), "attention_dispatch"))
    if cancel:
        # Raises InterruptProcessingException (and clears the flag) when the user cancelled: the prompt ends as
        # interrupted, the way ComfyUI's own loops stop.
        auto.set_interrupt_check(comfy.model_management.throw_exception_if_processing_interrupted)
    auto.set_progress_hook(show_progress)


TUNING_EVENT = "attention_dispatch.tuning"


def show_progress(event: auto.TuningProgress) -> None:
    """The step as progress text on the running node (the sampler: tuning happens in its first steps). Before the
    first text, TUNING_EVENT names the node to every page (as the text goes to every page): the frontend grows the
    node for the text and never shrinks it back, so the web extension gives it back its height once the text is gone."""
    from comfy_execution.utils import get_executing_context
    from server import PromptServer

    context, server = get_executing_context(), getattr(PromptServer, "instance", None)
    if context is not None and server is not None:
        if event.stage == "start":
            server.send_sync(TUNING_EVENT, {"node": context.node_id, "prompt_id": context.prompt_id})
        server.send_progress_text(event.text(), context.node_id)
