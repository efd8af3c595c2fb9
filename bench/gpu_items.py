"""What `bench/gpu_run.py` runs on a GPU machine, in priority order (issue 46): the figures that matter most first.

Groups: 1 the check kernel (the guard's tests, its time and memory per call, its cost on video calls, the re-fit of
the guard's cost model), 2 spoiled calls (one block turning bad at step 5 of 20), 3 the whole step per model and a
small call's host time, 4 the rest of tests/gpu, 5 the kernels side by side (issue 50's FP8 runs).

Each item is one command run from the repository root. In its arguments `{python}` is the interpreter, `{out}` the
item's results stem (RESULTS/DATE-MACHINE-NAME: the item adds .json; its output goes to the stem's .txt),
`{out:OTHER}` another item's stem, `{comfyui}` the carried ComfyUI, `{before}` the carried pack of the previous
main. `optional` adds arguments when a path was carried. Needs (bench/gpu_run.py decides each): `gpu`; `fa3` (fa3-fwd carried: `_flash_3` and
`flash_3_fp8` run); `sage` (SageAttention 2 built here or its wheel carried); `comfyui` (a ComfyUI checkout carried,
set as COMFYUI_PATH); `quiet` (no build running beside it: host-time figures); `after:NAME`.

Estimates (`estimate_s`, the item's own start included) come from the figures in bench/results/README.md, measured
on the H200 and the H100 (2026-12-02..05): a call of WAN 1.3B's self-attention (1, 12, 32760, 128) 8-10 ms (FA3 9.6,
Sage per warp ~8), Wan 14B's 27-39 ms, Flux's 0.4-0.8 ms; a WAN 1.3B step 490-590 ms, an SDXL step 57-60 ms; `auto_fast`
tuning Wan 14B 12-22 s; whole tests/gpu 62-90 s; torch.compile of WAN 1.3B 56-88 s per configuration; a Python
process that imports torch and the pack ~8 s. The limit is about twice the estimate: an item past it is stopped.
`cpu`: arguments appended (argparse keeps the last of a repeated option) for `gpu_run.py --cpu-smoke`, which runs
the items that have them on a CPU at toy sizes, to try the run itself where there is no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Item:
    name: str  # its results are DATE-MACHINE-NAME.json / .txt
    group: int
    argv: tuple[str, ...]
    estimate_s: int
    limit_s: int
    basis: str  # what the estimate is made of
    needs: tuple[str, ...] = ("gpu",)
    env: dict = field(default_factory=dict)
    optional: dict = field(default_factory=dict)  # carried path placeholder -> arguments added when it exists
    cpu: tuple[str, ...] | None = None  # arguments that make it a CPU try (gpu_run.py --cpu-smoke), if it has one

    @property
    def script(self) -> str:
        """The repository file the item runs (a script, or the first test file of a pytest item)."""
        args = self.argv[3:] if self.argv[1:3] == ("-m", "pytest") else self.argv[1:]
        return next(a for a in args if a.endswith(".py"))

    @property
    def pytest(self) -> bool:
        return self.argv[1:3] == ("-m", "pytest")


PY = "{python}"
PYTEST = (PY, "-m", "pytest", "-o", "addopts=", "-m", "gpu", "-p", "no:cacheprovider", "-q", "-rfEs",
          "--junitxml={out}.xml")
GUARD = (PY, "bench/guard_cost.py")
STEP = (PY, "bench/comfy_model_step.py", "--table", "--json", "{out}.json", "--compiled-models", "wan1.3b,flux")
# Exact kernels pinned in the step table. flex is left out: slower than cuDNN on every model shape measured (run 5)
# and out of memory on WAN's 32760 tokens (runs 2-3); _flash_varlen_3 is _flash_3's kernel through varlen.
STEP_KERNELS = "native,_native_cudnn,_native_flash,_native_efficient,_flash_3,flash_4"
SIDE = (PY, "bench/side_by_side.py", "--runs", "15", "--fp8-parts", "--json", "{out}.json", "--backends",
        "_native_cudnn,_flash_3,flash_4,flash_3_fp8,sage_sm90_per_warp,auto_exact,auto_fast")
TINY = ("--device", "cpu", "--tokens", "256", "--heads", "2", "--head-dim", "32", "--blocks", "8", "--bad-block", "3",
        "--steps", "6", "--bad-from-step", "2")  # one-bad-block at toy size
SIDE_SHAPES = {"wan14b": ("1,40,32760,128", 75, "Wan 14B: 7 backends x 15 samples of ~0.2 s, auto_fast tuning "
                                                "12-22 s, FA4's first call ~3 s"),
               "wan1.3b": ("1,12,32760,128", 55, "WAN 1.3B: 7 x 15 samples of ~0.2 s, tuning ~8 s"),
               "flux": ("1,24,4608,128", 45, "Flux: 7 x 15 samples of ~0.2 s, short tunings")}

ITEMS = [
    # 1: the check kernel
    Item("guard-tests", 1, PYTEST + ("tests/gpu/test_gpu_guard.py",), 45, 180,
         "~20 tests; tests/gpu whole took 62-90 s for ~140 (2026-12-04, -05); the Sage cases skip until Sage is there",
         env={"ATTN_GPU_RESULTS": "{out}.json"}),
    Item("guard-check-time", 1, GUARD + ("--scenario", "check-time", "--rounds", "40", "--json", "{out}.json"), 40, 180,
         "6 shapes x 40 interleaved (check, call) pairs, the longest Wan 14B's ~40 ms: ~5 s, Triton compiles, start",
         cpu=("--device", "cpu", "--shapes", "tiny", "--rounds", "3")),
    Item("guard-refit", 1, (PY, "bench/guard_fit.py", "{out:guard-check-time}.json", "--json", "{out}.json"), 10, 60,
         "arithmetic on guard-check-time's JSON", needs=("after:guard-check-time",)),
    Item("guard-call-cost-fp8", 1, GUARD + ("--scenario", "call-cost", "--shapes", "wan1.3b,wan14b", "--backend",
                                            "flash_3_fp8", "--blocks", "30", "--rounds", "8", "--json", "{out}.json"),
         60, 200, "36 forwards x 30 calls per shape at ~9 ms (WAN 1.3B) and ~27 ms (Wan 14B): 39 s, start 10 s; "
         "FA3's FP8 kernel is quantised, so guarded, and needs no SageAttention build", needs=("gpu", "fa3"),
         cpu=("--device", "cpu", "--shapes", "tiny", "--backend", "native", "--blocks", "4", "--rounds", "2")),
    Item("guard-call-cost", 1, GUARD + ("--scenario", "call-cost", "--shapes", "wan1.3b,wan14b", "--backend",
                                        "auto_fast", "--blocks", "30", "--rounds", "8", "--json", "{out}.json"),
         90, 240, "as guard-call-cost-fp8, plus auto_fast's tuning of both shapes (~8 s and 12-22 s)",
         needs=("gpu", "fa3", "sage")),
    # 2: spoiled calls. First with the bench's simulated int8 kernel (quantised, wrong on the outlier block like Sage,
    # needs nothing built), then with auto_fast over the real kernels, as the issue asks.
    *[Item(f"guard-one-bad-block-int8-sim{suffix}", 2,
           GUARD + ("--scenario", "one-bad-block", "--kernel", "int8-sim", "--bad-from-step", "5", *extra,
                    "--json", "{out}.json"), estimate, 150,
           "600 calls of WAN 1.3B's self-attention at ~10-12 ms (SDPA behind the simulated quantisation) and their "
           "errors against exact attention: ~10 s, start 10 s" + (", 600 checks" if extra == ("--every", "1") else ""),
           cpu=TINY)
      for suffix, extra, estimate in (("", (), 35), ("-shared-site", ("--shared-site",), 35),
                                      ("-every1", ("--every", "1"), 40))],
    *[Item(f"guard-one-bad-block{suffix}", 2,
           GUARD + ("--scenario", "one-bad-block", "--backend", "auto_fast", "--bad-from-step", "5", *extra,
                    "--json", "{out}.json"), estimate, 180,
           "600 calls at ~8-10 ms (Sage per warp, FA3), auto_fast's tuning ~8 s, start 10 s"
           + (", 600 checks" if extra == ("--every", "1") else ""), needs=("gpu", "fa3", "sage"))
      for suffix, extra, estimate in (("", (), 45), ("-shared-site", ("--shared-site",), 45),
                                      ("-every1", ("--every", "1"), 50))],
    Item("guard-tests-sage", 2, PYTEST + ("tests/gpu/test_gpu_guard.py", "-k", "sage"), 40, 180,
         "the two Sage cases of test_gpu_guard.py (a bad block among 2, auto_fast's tuning)",
         needs=("gpu", "sage")),
    # 3: the whole step, one model and mode per item (a call holds one), and a small call's host time
    Item("step-table-sd1.5", 3, STEP + ("--models", "sd1.5", "--modes", "eager", "--runs", "20", "--kernels",
                                        STEP_KERNELS), 70, 240,
         "9 configurations x 22 forwards of a ~25 ms step: 5 s; tuning its signatures, building the UNet, start",
         needs=("gpu", "fa3", "sage", "comfyui", "quiet")),
    Item("step-table-sdxl", 3, STEP + ("--models", "sdxl", "--modes", "eager", "--runs", "20", "--kernels",
                                       STEP_KERNELS), 80, 240,
         "9 configurations x 22 forwards of a 57-60 ms step: 12 s; tuning 4+ signatures, start",
         needs=("gpu", "fa3", "sage", "comfyui", "quiet")),
    Item("step-table-flux", 3, STEP + ("--models", "flux", "--modes", "eager", "--runs", "10", "--kernels",
                                       STEP_KERNELS), 90, 300,
         "9 configurations x 12 forwards of a ~0.2 s step (Flux dev, 1024x1024): 22 s; 12B random weights built "
         "on the GPU; tuning", needs=("gpu", "fa3", "sage", "comfyui")),
    Item("step-table-wan1.3b", 3, STEP + ("--models", "wan1.3b", "--modes", "eager", "--runs", "5", "--kernels",
                                          STEP_KERNELS), 110, 300,
         "9 configurations x 7 forwards of a 0.5-1.1 s step: 45 s; auto_fast's tuning ~10 s, start",
         needs=("gpu", "fa3", "sage", "comfyui")),
    Item("small-call", 3, (PY, "bench/small_call.py", "--rounds", "30", "--breakdown", "--inference-mode", "--order",
                           "cudnn", "--json", "{out}.json"), 60, 180,
         "30 rounds x 200 calls of ~35-60 us for 5-7 configurations, host times of ~15 layers, start",
         needs=("gpu", "comfyui", "quiet"), optional={"{before}": ("--before", "{before}")},
         cpu=("--device", "cpu", "--shape", "1,2,16,64", "--rounds", "3", "--calls", "10")),
    Item("step-table-wan1.3b-compiled", 3, STEP + ("--models", "wan1.3b", "--modes", "compiled", "--runs", "5",
                                                   "--kernels", "_flash_3"), 330, 500,
         "4 configurations (ComfyUI's own, FA3, the autos) x torch.compile 56-88 s each, 7 forwards of ~0.45 s",
         needs=("gpu", "fa3", "sage", "comfyui")),
    Item("step-table-flux-compiled", 3, STEP + ("--models", "flux", "--modes", "compiled", "--runs", "5",
                                                "--kernels", "_flash_3"), 360, 520,
         "4 configurations x torch.compile of Flux's 57 blocks (not measured yet; taken as WAN's ~80 s each)",
         needs=("gpu", "fa3", "sage", "comfyui")),
    # 4: the rest of tests/gpu (with Sage and FA3 there; comfy-kitchen and FA4 cases skip unless carried)
    Item("gpu-tests", 4, PYTEST + ("tests/gpu", "--ignore", "tests/gpu/test_gpu_guard.py", "--ignore",
                                   "tests/gpu/test_gpu_fp8.py"), 110, 300,
         "tests/gpu whole took 62-90 s (2026-12-04, -05); less the guard's and FP8's files, start",
         needs=("gpu", "fa3", "sage"), env={"ATTN_GPU_RESULTS": "{out}.json"}),
    # 5: the kernels side by side (issue 50's FP8 runs), the FP8 tests
    *[Item(f"side-by-side-{shape}-{inputs}", 5, SIDE + ("--shape", dims, "--inputs", inputs), estimate, 240,
           basis, needs=("gpu", "fa3", "sage"))
      for inputs in ("noise", "local", "outlier") for shape, (dims, estimate, basis) in SIDE_SHAPES.items()],
    Item("gpu-fp8-tests", 5, PYTEST + ("tests/gpu/test_gpu_fp8.py",), 45, 180,
         "13 tests in 22 s on the H100 (2026-12-05), start", needs=("gpu", "fa3"),
         env={"ATTN_GPU_RESULTS": "{out}.json"}),
]
