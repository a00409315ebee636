"""`python tools/eval.py ...` = `ds-tree eval ...`: see ds_tree/cli/eval.py."""

from ds_tree.cli.eval import main

raise SystemExit(main())
