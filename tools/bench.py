"""`python tools/bench.py ...` = `ds-tree bench ...`: see ds_tree/cli/bench.py."""

from ds_tree.cli.bench import main

raise SystemExit(main())
