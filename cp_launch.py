"""Start ComfyUI context-parallel, one process per GPU; run from the ComfyUI folder:

    python custom_nodes/attention_dispatch/cp_launch.py --nproc 2 -- <your usual main.py arguments>

The launcher itself is nodes/cp_launch.py (see there, and README "Context parallelism").
"""

import os
import runpy

if __name__ == "__main__":
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "nodes", "cp_launch.py"),
                   run_name="__main__")
