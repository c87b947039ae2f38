"""The maths of GRPO as pure functions: `advantages` (group-normalised advantages), `loss` (the clipped
objective, KL estimators, token aggregation), `rollout_is` (the importance-sampling correction for a sampler's
own log-probs)."""
