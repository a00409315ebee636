#!/usr/bin/env python
"""`python tools/multiturn_reuse.py ...` = `ds-tree multiturn-reuse ...`: see ds_tree/cli/multiturn_reuse.py."""

from ds_tree.cli.multiturn_reuse import main

raise SystemExit(main())
