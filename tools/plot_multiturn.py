#!/usr/bin/env python
"""`python tools/plot_multiturn.py ...` = `ds-tree plot-multiturn ...`: see ds_tree/cli/plot_multiturn.py."""

from ds_tree.cli.plot_multiturn import main

raise SystemExit(main())
