"""Run by ComfyUI-Manager after `pip install -r requirements.txt`, from this folder, with ComfyUI's Python.

Detects the machine, prints which attention backends can run, fetches and pins the Hub kernels that
fit (`python install.py --help`). It never installs or changes torch and always exits 0 on machine,
network or Hub problems. The logic lives in dispatcher/tools/installer.py, install_plan.py and
fetch.py there.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # the pack folder is not a package here: import `dispatcher` from it
    sys.path.insert(0, HERE)


def main() -> int:
    try:
        from dispatcher.tools.installer import main as run
    except Exception as exc:  # noqa: BLE001  (torch missing or broken: say so, never fail the install)
        print(f"[attention-dispatch] install.py: the dispatcher does not import ({type(exc).__name__}: {exc}); "
              "nothing was fetched. ComfyUI will show the same problem when it loads the pack.")
        return 0
    return run(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
