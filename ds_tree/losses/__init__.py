"""Training objectives on packed rows."""

from ds_tree.losses.sft import NORMALISATIONS, POLICIES, Normalisers, check_objective, restoration_weights, weighted_nll

__all__ = ["NORMALISATIONS", "POLICIES", "Normalisers", "check_objective", "restoration_weights", "weighted_nll"]
