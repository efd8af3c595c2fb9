"""The chart of `bench/comfy_model_step.py --table`, and the README's slot that links it.

    python bench/step_table.py step-table.json --png bench/results/DATE-h200-step-table.png [--readme README.md]

One panel per mode (eager, compiled): for each model, every configuration's speed-up over ComfyUI's own
attention (1.0: the dashed line), the autos hatched. --readme replaces the text between the README's
`<!-- step-table -->` and `<!-- /step-table -->` markers with the chart's link and the table itself, so the
README shows the figures of the run the chart was drawn from and nothing older.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

START, END = "<!-- step-table -->", "<!-- /step-table -->"


def write_png(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["table"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 3.8 * len(modes)), constrained_layout=True, squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        mine = [r for r in rows if r["mode"] == mode and r.get("vs_comfy")]
        models = list(dict.fromkeys(r["model"] for r in mine))
        configs = list(dict.fromkeys(r["attention"] for r in mine))
        width = 0.8 / max(1, len(configs))
        top = 1.0
        for i, config in enumerate(configs):
            xs, ys = [], []
            for j, model in enumerate(models):
                row = next((r for r in mine if r["model"] == model and r["attention"] == config), None)
                if row is not None:
                    xs.append(j + (i - (len(configs) - 1) / 2) * width)
                    ys.append(row["vs_comfy"])
            top = max([top] + ys)
            # matplotlib hides legend labels that start with "_" (the pinned SDPA kernels): a leading space
            ax.bar(xs, ys, width, label=" " + config if config.startswith("_") else config,
                   hatch="//" if config.startswith("auto") else None)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=0.9, label="1.0 = ComfyUI's own attention")
        ax.set_ylim(0, top * 1.12)  # never clipped: the tallest bar sets the scale
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models)
        ax.set_ylabel("ComfyUI's own ms / ms")
        ax.set_title(f"One step, {mode} ({data.get('device', '?')}, torch {data.get('torch', '?')}, "
                     f"median of {data.get('runs', '?')})")
        ax.legend(fontsize=7, ncol=min(5, len(configs) + 1))
    fig.savefig(path, dpi=110)


def markdown(data: dict) -> str:
    lines = ["| model | mode | attention | ms | x ComfyUI's own | x best pinned exact | served by |",
             "|---|---|---|---|---|---|---|"]
    for r in data["table"]:
        lines.append(f"| {r['model']} | {r['mode']} | {r['attention']} | {r['ms']:.2f} | "
                     f"{r['vs_comfy']:.3f} | {r['vs_best_pinned']:.3f} | {', '.join(r['served'])} |"
                     if r.get("vs_best_pinned") else
                     f"| {r['model']} | {r['mode']} | {r['attention']} | {r['ms']:.2f} | "
                     f"{(r.get('vs_comfy') or 0):.3f} |  | {', '.join(r['served'])} |")
    return "\n".join(lines)


def fill_readme(readme: Path, data: dict, png: str, source: str) -> None:
    """Put the chart's link and the table between the README's markers (they must be there, once)."""
    text = readme.read_text()
    if text.count(START) != 1 or text.count(END) != 1:
        raise SystemExit(f"{readme} needs one {START} ... {END} slot")
    link = Path(png).as_posix()
    block = (f"{START}\nOne step of each model on {data.get('device', '?')} (`{source}`; "
             f"`bench/comfy_model_step.py --table`): ComfyUI's own attention, each exact kernel pinned, "
             f"`auto_exact` and `auto_fast`.\n\n![Step time per model and attention]({link})\n\n{markdown(data)}\n{END}")
    head, rest = text.split(START, 1)
    readme.write_text(head + block + rest.split(END, 1)[1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json_path")
    parser.add_argument("--png", required=True)
    parser.add_argument("--readme", type=Path)
    args = parser.parse_args(argv)
    data = json.loads(Path(args.json_path).read_text())
    write_png(data, args.png)
    print(f"wrote {args.png}")
    if args.readme is not None:
        fill_readme(args.readme, data, args.png, Path(args.json_path).name)
        print(f"filled the step-table slot of {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
