"""Helpers shared by the tests (not tests themselves; pytest collects no file here).

Imported as `helpers.<module>`: pyproject.toml's `pythonpath` puts tests/ on sys.path.

- pack: this pack imported as ComfyUI does (`load_pack`, `PACK`) and a fake ComfyUI attention `comfy_func`
- tensors: `qkv(...)`, random attention inputs
- dispatcher_state: put a dispatcher back to its defaults between tests
- node_stub: the pack's V3 nodes without ComfyUI (stand-in `comfy_api`), `FakeModel`
- kernel_repos: Hub kernel repositories built on disk, for the real `kernels` library; also a script
- fake_hub: a local stand-in for the Hugging Face Hub
- install_runner: a script that runs the real install.py in a fresh interpreter
- gloo_ranks: spawning gloo ranks for the context-parallel tests
- triton_interpreter: a script run by Triton's CPU interpreter, in a process of its own
"""
