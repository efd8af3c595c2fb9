"""Start ComfyUI context-parallel: one ComfyUI process per GPU (or CPU rank), executing prompts in lockstep.

Run from the ComfyUI folder (the pack's root cp_launch.py runs this file):

    python custom_nodes/attention_dispatch/cp_launch.py --nproc 2 -- --listen 127.0.0.1 --port 8188

Everything after ``--`` goes to ComfyUI's main.py, on every rank. Rank 0 is a normal ComfyUI (HTTP
server, browser, queue); ranks 1..N-1 are headless workers (ComfyUI's own `main.start_comfyui()`, never
listening) that execute each prompt rank 0 executes, as rank 0 starts it (nodes/cp_runtime.py). Use
the Context Parallel Attention node in a workflow to split its attention over the ranks.

- GPUs: backend NCCL, rank r sees only the r-th visible GPU (CUDA_VISIBLE_DEVICES), so it needs
  --nproc GPUs. CPUs (``--cpu`` among ComfyUI's arguments, or ``--backend gloo``): backend gloo.
- Every rank loads the whole model (weights are replicated): the split saves attention time and
  attention memory, not weight memory.
- The ranks talk over 127.0.0.1 (MASTER_ADDR), one machine only.
- Workers write outputs (SaveImage, ...) to a temporary folder of their own, removed at exit; they use
  rank 0's models, inputs and user folder, and an in-memory database.
- When any rank exits, the launcher stops the others.

This file uses only the standard library until a worker imports ComfyUI; it imports nothing of the pack.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)  # not resolved: custom_nodes/<pack>/nodes/cp_launch.py finds ComfyUI two up
ENV_WORKDIR = "ATTN_DISPATCH_CP_WORKDIR"
REFUSED = {"--cuda-device": "the launcher gives rank r the r-th visible GPU; choose GPUs with CUDA_VISIBLE_DEVICES",
           "--default-device": "the launcher gives rank r the r-th visible GPU; choose GPUs with CUDA_VISIBLE_DEVICES"}


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cp_launch.py", description="Start ComfyUI over several ranks for Context Parallel Attention. "
        "Arguments after -- go to ComfyUI's main.py on every rank.")
    p.add_argument("--nproc", type=int, required=True, help="number of ranks (processes), one per GPU")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                   help="torch.distributed backend: auto = gloo with --cpu, else nccl")
    p.add_argument("--comfyui", default=None,
                   help="the ComfyUI folder (default: the current folder, else the one this pack is installed in)")
    p.add_argument("--master-port", type=int, default=0, help="rendezvous port on 127.0.0.1 (default: a free one)")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # internal: run rank N headless
    return p


def _is_comfyui(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "main.py")) and os.path.isdir(os.path.join(path, "comfy"))


def find_comfyui(given: str | None) -> str:
    candidates = [given] if given else [os.getcwd(), os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.dirname(HERE))))]
    for path in candidates:
        if path and _is_comfyui(path):
            return os.path.abspath(path)
    raise SystemExit(f"cp_launch.py: no ComfyUI found in {' or '.join(map(str, candidates))} (a folder with main.py "
                     "and comfy/); run it from the ComfyUI folder or pass --comfyui PATH")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    try:
        import torch
        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - no torch / no CUDA: no GPUs
        return []


def plan(nproc: int, backend: str, comfy_args: list[str], master_port: int, comfy_dir: str,
         python: str = sys.executable) -> list[tuple[list[str], dict]]:
    """The command and extra environment of every rank (rank 0 first)."""
    if nproc < 1:
        raise SystemExit("cp_launch.py: --nproc must be >= 1")
    for flag, why in REFUSED.items():
        if any(a == flag or a.startswith(flag + "=") for a in comfy_args):
            raise SystemExit(f"cp_launch.py: {flag} cannot be used here: {why}")
    if backend == "auto":
        backend = "gloo" if "--cpu" in comfy_args else "nccl"
    gpus = []
    if backend == "nccl":
        gpus = _gpus()
        if len(gpus) < nproc:
            raise SystemExit(f"cp_launch.py: --nproc {nproc} with NCCL needs {nproc} GPUs, {len(gpus)} visible; "
                             "pass fewer ranks, or --cpu to ComfyUI (gloo, CPU ranks)")
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "WORLD_SIZE": str(nproc),
              "LOCAL_WORLD_SIZE": str(nproc), "ATTN_DISPATCH_CP": "1", "ATTN_DISPATCH_CP_BACKEND": backend}
    if os.path.exists("/sys/class/net/lo") and "GLOO_SOCKET_IFNAME" not in os.environ:
        common["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's pairs on 127.0.0.1, never another interface
    ranks = []
    for r in range(nproc):
        env = dict(common, RANK=str(r), LOCAL_RANK=str(r))
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[r]
        if r == 0:
            cmd = [python, os.path.join(comfy_dir, "main.py"), *comfy_args]
        else:
            cmd = [python, HERE, "--nproc", str(nproc), "--worker", str(r), "--comfyui", comfy_dir, "--", *comfy_args]
        ranks.append((cmd, env))
    return ranks


def launch(argv: list[str]) -> int:
    mine, comfy_args = _split(argv)
    opts = _parser().parse_args(mine)
    comfy_dir = find_comfyui(opts.comfyui)
    if opts.worker is not None:
        return worker(opts.worker, comfy_dir, comfy_args)
    ranks = plan(opts.nproc, opts.backend, comfy_args, opts.master_port or _free_port(), comfy_dir)
    workdirs, procs = [], []

    def stop(*_):
        for p in procs:
            if p.poll() is None:
                p.terminate()

    signal.signal(signal.SIGTERM, lambda *a: (stop(), sys.exit(143)))
    code = 0
    try:
        for r, (cmd, extra) in enumerate(ranks):
            env = dict(os.environ, **extra)
            if r:
                workdirs.append(tempfile.mkdtemp(prefix=f"comfyui-cp-rank{r}-"))
                env[ENV_WORKDIR] = workdirs[-1]
            procs.append(subprocess.Popen(cmd, cwd=comfy_dir, env=env))
        print(f"cp_launch.py: {len(procs)} ranks started (rank 0 pid {procs[0].pid} serves ComfyUI)", flush=True)
        while True:
            done = [(r, p.returncode) for r, p in enumerate(procs) if p.poll() is not None]
            if done:
                r, code = done[0]
                if len(procs) > 1:
                    print(f"cp_launch.py: rank {r} exited with {code}; stopping the other ranks", flush=True)
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        code = 130
    finally:
        stop()
        deadline = time.time() + 20
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for d in workdirs:
            shutil.rmtree(d, ignore_errors=True)
    return code


def worker(rank: int, comfy_dir: str, comfy_args: list[str]) -> int:
    """Rank > 0: ComfyUI's own start-up and prompt worker, without the HTTP server; prompts come from rank 0."""
    workdir = os.environ.get(ENV_WORKDIR) or tempfile.mkdtemp(prefix=f"comfyui-cp-rank{rank}-")
    signal.signal(signal.SIGTERM, lambda *a: (sys.stdout.flush(), os._exit(0)))
    os.chdir(comfy_dir)
    sys.path.insert(0, comfy_dir)
    sys.argv = [os.path.join(comfy_dir, "main.py"), *comfy_args]
    import comfy.options
    comfy.options.enable_args_parsing()
    from comfy.cli_args import args
    import folder_paths
    shared_output = os.path.abspath(args.output_directory) if args.output_directory else \
        folder_paths.get_output_directory()
    args.output_directory = os.path.join(workdir, "output")  # this rank's SaveImage & co. must not race rank 0's
    args.temp_directory = workdir                            # ComfyUI empties its temp folder at start
    if hasattr(args, "database_url"):
        args.database_url = "sqlite:///:memory:"             # the user database stays rank 0's
    args.auto_launch = False
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if not args.cpu:
        try:
            import cuda_malloc  # noqa: F401 - the allocator choice main.py makes before importing torch
        except Exception:  # noqa: BLE001
            pass
    import main  # ComfyUI's module-level set-up (paths, prestartup scripts), not its __main__ block
    for name in ("checkpoints", "clip", "vae", "diffusion_models", "loras"):  # what main.py adds from the output
        folder_paths.add_model_folder_path(name, os.path.join(shared_output, name))
    loop, server, _start_all = main.start_comfyui()
    print(f"cp_launch.py: rank {rank} ready (headless, outputs in {args.output_directory})", flush=True)
    try:
        loop.run_until_complete(server.publish_loop())  # drains the events its executor sends (no clients)
    except KeyboardInterrupt:
        pass
    sys.stdout.flush()
    os._exit(0)  # the prompt worker thread may sit in a collective: do not wait for it


def main(argv: list[str] | None = None) -> int:
    return launch(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
