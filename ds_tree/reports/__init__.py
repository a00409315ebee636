"""Runs read back and drawn: metrics.jsonl records, figures, the plot commands' curves and tables."""
