#!/usr/bin/env python
"""`python tools/verify.py ...` = `ds-tree verify ...`: see ds_tree/cli/verify.py."""

from ds_tree.cli.verify import main

raise SystemExit(main())
