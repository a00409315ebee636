"""``python -m ds_tree.cli COMMAND ...`` = ``ds-tree COMMAND ...`` (the console script)."""

from ds_tree.cli import main

raise SystemExit(main())
