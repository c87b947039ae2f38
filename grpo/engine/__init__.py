"""The shared-prefix engine: per-token log-probs of GRPO groups with each prompt encoded once per group.

Public entries: :func:`token_logprobs` and :func:`plan_micro_batches` (also ``grpo.token_logprobs`` and
``grpo.plan_micro_batches``). One module per job (docs/prefix-engine.md):

- ``logprobs``: token_logprobs, the entry point: inputs, layout and kernel choice, micro-batches, standard layout
- ``layout``: the packed row of a micro-batch: which tokens exist, their positions, segments, predicting positions
- ``prefix_attention``: the ``grpo_prefix`` attention function every layer calls; dispatches to a kernel
- ``grouped_attention``: the grouped kernel and the joint softmax shared with decoding
- ``completion_attention``: the grouped kernel's completion half, with flash-style memory (any device)
- ``merged_attention``: that half on CPU: two fused flash-attention calls merged by their log-sum-exps
- ``flex_kernel``: the FlexAttention kernel and its block mask
- ``decode_attention``: ``grpo_prefix_decode``, the rollout's shared-prefix (cascade) decoding
- ``state_layers``: recurrent layers (Gated DeltaNet, Mamba2, short convolutions): each completion continues from
  its prompt's state; the rollout's states copied to the G rows
- ``patch``: switching a model's attention to ours, the placeholder mask, the every-layer check
- ``logprob_head``: log p and entropy from hidden states without storing vocabulary logits
- ``vision_logprobs``: the same for prompts with images (Qwen2.5-VL): the vision tower once per prompt, 3-D positions
- ``micro_batches``: cutting groups into micro-batches under a token budget
- ``memory``: sizing that budget from the model and the free memory
- ``unwrap``: the model inside DDP / DeepSpeed / peft wrappers
"""

from grpo.engine.logprobs import token_logprobs
from grpo.engine.micro_batches import plan_micro_batches

__all__ = ["token_logprobs", "plan_micro_batches"]
