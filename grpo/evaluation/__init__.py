"""Evaluation and alarms as pure functions: pass@k / maj@k / mean@n over a prompt's samples (`metrics`), and the rules
that watch a run's logged metrics (`alarms`). The trainer (`grpo.trainer.evaluate`, `grpo.eval`) feeds them."""
