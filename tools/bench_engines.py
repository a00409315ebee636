#!/usr/bin/env python
"""`python tools/bench_engines.py ...` = `ds-tree bench-engines ...`: see ds_tree/cli/bench_engines.py."""

from ds_tree.cli.bench_engines import main

raise SystemExit(main())
