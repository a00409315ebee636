"""Hugging Face models with tree attention, and log-probabilities on packed rows."""

from ds_tree.models.loading import load_config, load_model, parse_dtype
from ds_tree.models.logprobs import predicted_tokens, target_logprobs

__all__ = ["load_config", "load_model", "parse_dtype", "predicted_tokens", "target_logprobs"]
