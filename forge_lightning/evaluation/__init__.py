"""Validation: the greedy completions' scores (validation.py), sampled evaluation with pass@k and
maj@k (sampled.py), and each prompt counted once across ranks (ranks.py)."""
