"""`python tools/bench_attention.py ...` = `ds-tree bench-attention ...`: see ds_tree/cli/bench_attention.py."""

from ds_tree.cli.bench_attention import main

raise SystemExit(main())
