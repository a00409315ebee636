"""`python tools/sample.py ...` = `ds-tree sample ...`: see ds_tree/cli/sample.py."""

from ds_tree.cli.sample import main

raise SystemExit(main())
