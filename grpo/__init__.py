"""grpo: Group Relative Policy Optimization with a shared-prefix forward engine."""
from grpo.engine import plan_micro_batches, token_logprobs

__all__ = ["token_logprobs", "plan_micro_batches"]
__version__ = "0.1.0"
