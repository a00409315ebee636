"""`python tools/plot_online.py ...` = `ds-tree plot-online ...`: see ds_tree/cli/plot_online.py."""

from ds_tree.cli.plot_online import main

raise SystemExit(main())
