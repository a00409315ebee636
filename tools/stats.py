"""`python tools/stats.py ...` = `ds-tree stats ...`: see ds_tree/cli/stats.py."""

from ds_tree.cli.stats import main

raise SystemExit(main())
