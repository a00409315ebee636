"""POR sweep on synthetic trees plus the real shared data sets: tree vs flat, plot and table.

Every point is --repeats runs of one tools/bench.py command (recorded with its result), each a
separate process: on the shared 2-core machine a single run's speedup moves by up to ~10% from one
run to the next, with both modes slowing or speeding together but not equally. The point
reported is the run with the median efficiency; every run's figures are kept under "repeats" and
the table shows their range. Writes OUT/results.json, OUT/speedup.png (measured speedup vs
ideal, with y = x) and OUT/table.md. Real data (--shared) is converted with the project
tokenizer first (ds-tree convert).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from ds_tree.cli.common import POSITIVE_INT, command_parser
from ds_tree.data.jsonl import json_text

ROOT = Path(__file__).resolve().parents[2]
"""The repository: bench.py runs there, and data paths are recorded relative to it."""

# (name, source file, groups, trials per group, bench.py options, most repeats): slices keep CPU
# runs short.
SHARED = [
    ("tot-game24", "tot-game24/samples.jsonl", 2, 32, ["--groups-per-step", "2", "--budget", "4096"], None),
    (
        "tau2-telecom",
        "tau2-telecom/trials.jsonl",
        1,
        4,
        ["--groups-per-step", "1", "--budget", "16384", "--warmup", "0", "--steps", "3"],
        1,
    ),  # a flat step takes a minute: 3 steps, no warm-up, one run
]


def run(command: list[str]) -> str:
    print("+ " + " ".join(command), file=sys.stderr, flush=True)
    return subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT).stdout


def bench(args, name: str, data: Path, options: list[str], repeats: int | None = None) -> dict:
    out = args.out / f"{name}.json"
    data = data.relative_to(ROOT) if data.is_relative_to(ROOT) else data
    command = ["python", "tools/bench.py", "--data", str(data), "--model", args.model, "--steps", str(args.steps)]
    command += [*options, "--json", str(out)]  # a point's own --steps comes later and wins
    reports = []
    for _ in range(min(args.repeats, repeats or args.repeats)):
        run([sys.executable, *command[1:]])
        reports.append(json.loads(out.read_text()))
    reports.sort(key=lambda r: r.get("efficiency", 0.0))
    report = reports[(len(reports) - 1) // 2]
    report["name"] = name
    report["command"] = " ".join(command)
    report["repeats"] = [
        {
            "speedup": r.get("speedup"),
            "efficiency": r.get("efficiency"),
            "step_time_s": {mode: m["step_time_s"] for mode, m in r["modes"].items()},
        }
        for r in reports
    ]
    out.write_text(json_text(report, indent=2) + "\n")
    return report


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 5))
    top = max(max(r["ideal_speedup"], r["speedup"]) for r in results) * 1.1
    axes.plot([0, top], [0, top], "k--", linewidth=1, label="y = x (ideal)")
    for result in results:
        marker = "s" if result["name"].startswith("por") else "o"
        axes.scatter(result["ideal_speedup"], result["speedup"], marker=marker)
        axes.annotate(
            result["name"],
            (result["ideal_speedup"], result["speedup"]),
            fontsize=8,
            xytext=(4, -10),
            textcoords="offset points",
        )
    axes.set_xlabel("ideal speedup (flat tokens / tree tokens computed)")
    axes.set_ylabel("measured speedup (flat step time / tree step time)")
    axes.set_title("ds_tree tree vs flat, tiny Llama on 2 CPU cores")
    axes.set_xlim(0, top)
    axes.set_ylim(0, top)
    axes.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def table(results: list[dict]) -> str:
    lines = [
        "| data | POR | flat tok/step | ideal | speedup | efficiency | efficiency range (runs) | pair ratio "
        "| flat step s | tree step s | mem tree/flat |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        flat, tree = r["modes"]["flat"], r["modes"]["tree"]
        runs = [x["efficiency"] for x in r.get("repeats", [r])]
        lines.append(
            f"| {r['name']} | {r['por']:.3f} | {r['flat_tokens_per_step']:.0f} | {r['ideal_speedup']:.2f} | "
            f"{r['speedup']:.2f} | {r['efficiency']:.2f} | {min(runs):.2f}-{max(runs):.2f} ({len(runs)}) | "
            f"{r['visible_pair_ratio']:.2f} | "
            f"{flat['step_time_s']:.3f} | {tree['step_time_s']:.3f} | "
            f"{r.get('memory_ratio_tree_over_flat', float('nan')):.2f} |"
        )
    return "\n".join(lines) + "\n"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument("--out", type=Path, required=True, metavar="OUT", help="folder of the results")
    parser.add_argument("--model", default="configs/models/bench_llama.json", help="model config (default %(default)s)")
    parser.add_argument("--pors", default="0,0.25,0.5,0.7,0.85,0.95", help="target POR of each synthetic point")
    parser.add_argument("--groups", type=POSITIVE_INT, default=4, help="synthetic groups per step")
    parser.add_argument("--steps", type=POSITIVE_INT, default=5, help="measured steps per point (tau2: 3)")
    parser.add_argument("--repeats", type=POSITIVE_INT, default=3, help="bench.py runs per point (tau2: 1)")
    parser.add_argument(
        "--shared", type=Path, default=ROOT.parent / "shared" / "data", help="folder of the shared real data sets"
    )
    parser.add_argument("--skip-shared", action="store_true", help="the synthetic points only")
    parser.add_argument(
        "--work",
        type=Path,
        default=ROOT / ".cache" / "bench_sweep",
        help="generated and converted data (kept out of the repository: shared data is never copied in)",
    )
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    from ds_tree.data.convert import ConvertOptions, convert
    from ds_tree.data.jsonl import slice_groups
    from ds_tree.data.synthetic import SyntheticConfig, write_synthetic
    from ds_tree.vocab.tokenizer import save_tokenizer

    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for por in [float(p) for p in args.pors.split(",")]:
        data = work / f"synthetic_por{por:.2f}.jsonl"
        # POR 0 means one trial per task: as many trajectories per step as the other points.
        groups = args.groups * 8 if por == 0 else args.groups
        write_synthetic(SyntheticConfig(groups=groups, por=por, seed=0), data)
        results.append(bench(args, f"por{por:.2f}", data, ["--groups-per-step", str(groups), "--budget", "4096"]))
    if not args.skip_shared and args.shared.is_dir():
        tokenizer = work / "tokenizer"
        if not (tokenizer / "tokenizer.json").is_file():
            save_tokenizer(tokenizer)
        for name, source, groups, per_group, options, repeats in SHARED:
            dataset = work / name
            if not dataset.is_dir():
                sliced = slice_groups(args.shared / source, work / f"{name}.jsonl", groups, per_group)
                convert([sliced], dataset, tokenizer, ConvertOptions(format="chat"))
            results.append(bench(args, name, dataset, options, repeats))
    elif not args.skip_shared:
        print(f"bench-sweep: {args.shared} is absent: the real data sets are left out (docs/DATA.md)", file=sys.stderr)
    (args.out / "results.json").write_text(json_text(results, indent=2) + "\n")
    plot(results, args.out / "speedup.png")
    (args.out / "table.md").write_text(table(results))
    print(table(results))
    return 0
