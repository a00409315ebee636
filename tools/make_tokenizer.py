"""`python tools/make_tokenizer.py ...` = `ds-tree make-tokenizer ...`: see ds_tree/cli/make_tokenizer.py."""

from ds_tree.cli.make_tokenizer import main

raise SystemExit(main())
