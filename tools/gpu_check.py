#!/usr/bin/env python
"""`python tools/gpu_check.py ...` = `ds-tree gpu-check ...`: see ds_tree/cli/gpu_check.py."""

from ds_tree.cli.gpu_check import main

raise SystemExit(main())
