"""`python tools/bench_kernel.py ...` = `ds-tree bench-kernel ...`: see ds_tree/cli/bench_kernel.py."""

from ds_tree.cli.bench_kernel import main

raise SystemExit(main())
