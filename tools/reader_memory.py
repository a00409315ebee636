"""Resident memory of one rank reading converted datasets: lazily (TreeDatasetReader) against whole (load_trajectories).

    python tools/reader_memory.py DATASET [DATASET ...] [--world-size 64] [--groups-per-step 512] [--steps 3]

For each dataset, a fresh process per mode prints one JSON line: the process's VmRSS, RssAnon (its own
memory: heap, arrays) and RssFile (mapped file pages: clean, dropped by the kernel under pressure) in MiB,
after the imports, after opening the dataset, and after rank 0 of --world-size has planned each of --steps
steps of --groups-per-step groups (:mod:`ds_tree.packing.distributed`: its summary share and its items'
groups read, trees built, items made). docs/DATA.md ("Reading at scale") records a run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETUP = """
import pickle, sys
from ds_tree.data.dataset_reader import DatasetGroups, TreeDatasetReader
from ds_tree.data.sampler import StepSampler
from ds_tree.packing.distributed import RankPlanner
from ds_tree.packing.plan import PlanSettings
path, out, world, per_step, steps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
reader = TreeDatasetReader(path)
sampler = StepSampler(reader.n_groups, per_step, 0)
summaries = []
for step in range(steps):
    units = DatasetGroups(reader, sampler.groups_for_step(step))
    summaries.append([RankPlanner(units, PlanSettings(budget=8192), world, rank).summarise() for rank in range(world)])
pickle.dump(summaries, open(out, "wb"))
"""
"""Every rank's summaries of every step, computed beforehand: what the exchange delivers to the measured rank."""

RANK = """
import gc, json, pickle, sys
def memory():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {name: int(fields[name].split()[0]) // 1024 for name in ("VmRSS", "RssAnon", "RssFile")}
from ds_tree.data import load_trajectories
from ds_tree.data.dataset_reader import DatasetGroups, TreeDatasetReader
from ds_tree.data.sampler import StepSampler
from ds_tree.packing.distributed import GroupUnits, RankPlanner
from ds_tree.packing.plan import PlanSettings
from ds_tree.trees.trajectory import group_trajectories
path, mode, exchanged, world, per_step, steps = *sys.argv[1:4], *map(int, sys.argv[4:7])
out = {"dataset": path, "mode": mode, "imports": memory()}
if mode == "lazy":
    reader = TreeDatasetReader(path)
    n_groups, units_of = reader.n_groups, lambda rows: DatasetGroups(reader, rows)
else:
    groups = group_trajectories(load_trajectories(path))
    n_groups, units_of = len(groups), lambda rows: GroupUnits([groups[row] for row in rows])
out["opened"] = memory()
sampler = StepSampler(n_groups, per_step, 0)
everyone = pickle.load(open(exchanged, "rb"))
for step in range(steps):
    planner = RankPlanner(units_of(sampler.groups_for_step(step)), PlanSettings(budget=8192), world, 0)
    mine = planner.summarise()
    plan = planner.materialise(planner.balance([mine] + everyone[step][1:]))
    out[f"step_{step}_items"] = len(plan.rows)
    del planner, plan, mine
    gc.collect()
    out[f"after_step_{step}"] = memory()
print(json.dumps(out))
"""
"""Rank 0: open the dataset (lazy) or load it (eager), then plan each step with the others' summaries."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("datasets", nargs="+", type=Path)
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--groups-per-step", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["lazy", "eager"], choices=["lazy", "eager"])
    args = parser.parse_args(argv)
    numbers = [str(args.world_size), str(args.groups_per_step), str(args.steps)]
    with tempfile.TemporaryDirectory() as directory:
        for dataset in args.datasets:
            exchanged = str(Path(directory) / "summaries.pickle")
            runs = [[SETUP, str(dataset), exchanged]] + [[RANK, str(dataset), mode, exchanged] for mode in args.modes]
            for script, *arguments in runs:
                done = subprocess.run(
                    [sys.executable, "-c", script, *arguments, *numbers], cwd=ROOT, capture_output=True, text=True
                )
                if done.returncode:
                    print(done.stderr[-2000:], file=sys.stderr)
                    return done.returncode
                if script is RANK:
                    print(done.stdout.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
