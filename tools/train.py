"""`python tools/train.py ...` = `ds-tree train ...`: see ds_tree/cli/train.py."""

from ds_tree.cli.train import main

raise SystemExit(main())
