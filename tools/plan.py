"""`python tools/plan.py ...` = `ds-tree plan ...`: see ds_tree/cli/plan.py."""

from ds_tree.cli.plan import main

raise SystemExit(main())
