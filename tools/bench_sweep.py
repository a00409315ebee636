"""`python tools/bench_sweep.py ...` = `ds-tree bench-sweep ...`: see ds_tree/cli/bench_sweep.py."""

from ds_tree.cli.bench_sweep import main

raise SystemExit(main())
