"""One training batch: what it trains and when the optimizer steps (plan.py, with dynamic
sampling in dynamic_sampling.py), the loss passes over a rollout (loss_passes.py), the optimizer
(optim.py), and what a run adds to a checkpoint (run_state.py)."""
