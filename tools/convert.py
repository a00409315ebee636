"""`python tools/convert.py ...` = `ds-tree convert ...`: see ds_tree/cli/convert.py."""

from ds_tree.cli.convert import main

raise SystemExit(main())
