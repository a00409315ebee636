"""`python tools/make_synthetic.py ...` = `ds-tree make-synthetic ...`: see ds_tree/cli/make_synthetic.py."""

from ds_tree.cli.make_synthetic import main

raise SystemExit(main())
