"""Sampling groups of completions as trees (:mod:`.sampler`) and scoring them (:mod:`.rewards`)."""
