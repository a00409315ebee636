#!/usr/bin/env python
"""`python tools/reasoning_reuse.py ...` = `ds-tree reasoning-reuse ...`: see ds_tree/cli/reasoning_reuse.py."""

from ds_tree.cli.reasoning_reuse import main

raise SystemExit(main())
