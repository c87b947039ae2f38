"""Rollout for prompts with images (Qwen-VL, Gemma 3, Idefics3): each prompt's images and text prefilled once, G
samples decoded.

For every group, in order:

1. prefill the prompt once through the model's own forward, pixels and token kinds included: the vision tower runs
   once per prompt, and the model computes the prompt's rotary positions (Qwen-VL's 3-D ones) and its own mask
   (Gemma 3: each image's tokens attend to each other both ways), as ``generate`` prefills;
2. fork the prompt's cache (K/V, and a hybrid's recurrent states) to the G rows (``reorder_cache``) and sample
   each row's first token from the prompt's last logits;
3. decode: step k feeds each row's last token at the text position ``max(prompt positions) + 1 + k`` (every
   axis), the position the per-sequence forward and grpo/engine/vision_logprobs.py give it; no token kinds (a
   decoded token is text, as ``generate`` passes none after the prefill).

Sampling is grpo/rollout/hf.py's: softmax(logits / T) (or argmax), restricted to ``top_k`` / ``top_p`` where they
are set (then off-policy, with the same one-time warning); the log-prob of every sampled token under the full
softmax(logits / T), the trainer's, is returned alongside, so a caller can check it against the trainer's. Groups
are decoded one after the other (not batched across prompts yet).
"""
from __future__ import annotations

import torch

from grpo.engine.unwrap import unwrap_model
from grpo.engine.vision_families import family_of
from grpo.engine.vision_logprobs import prompt_positions
from grpo.rollout.base import Completions, Sampling, cut_at_eos
from grpo.rollout.hf import sample_tokens, warn_truncated_sampling
from grpo.vision.images import ImagePrompt


def generate_with_images(model, prompts, group_size: int, sampling: Sampling, eos: list[int],
                         seed: int | None = None) -> Completions:
    """G completions per :class:`grpo.vision.images.ImagePrompt`, with the sampler's log-prob of each token.
    ``eos``: the ids that end a completion (kept); ``sampling.greedy`` decodes one argmax completion per prompt."""
    if not sampling.greedy:
        warn_truncated_sampling(sampling.top_p, sampling.top_k)
    vlm = unwrap_model(model)  # a peft model: its base, the adapters injected and active
    gen = None  # seed None: the process's generator (checkpointed), as grpo/rollout/hf.py draws
    if seed is not None:
        gen = torch.Generator(device=vlm.device)
        gen.manual_seed(seed)
    prompts = [p if isinstance(p, ImagePrompt) else ImagePrompt(p) for p in prompts]  # token lists: no images
    G = 1 if sampling.greedy else group_size
    ids, cut, logps = [], [], []
    was_training = vlm.training
    vlm.eval()  # no dropout while sampling; and a model in training mode with gradient checkpointing keeps no cache
    try:
        with torch.no_grad():  # inside, not a decorator: mutmut mutates only undecorated functions
            groups = [_group(vlm, prompt, G, sampling, eos, gen) for prompt in prompts]
    finally:
        vlm.train(was_training)
    for toks, lps in groups:
        kept = [cut_at_eos(t, eos, sampling.max_new_tokens) for t in toks]
        ids.append([k for k, _ in kept])
        cut.append([c for _, c in kept])
        logps.append([lp[: len(k)] for lp, (k, _) in zip(lps, kept)])
    return Completions(ids=ids, truncated=cut, logprobs=logps)


def _group(vlm, prompt, G, sampling, eos, gen):
    """(G token lists, G log-prob tensors) of one prompt, each ``max_new_tokens`` long or stopped at EOS."""
    device, family = vlm.device, family_of(vlm)
    ids = torch.tensor([prompt.ids], device=device)
    images = {k: v.to(device) for k, v in family.image_inputs([prompt]).items()} if prompt.n_images else {}
    image_id = vlm.config.image_token_id
    kinds = {family.kinds_kwarg: (ids == image_id).int()} if family.kinds_kwarg else {}
    out = vlm(input_ids=ids, **kinds, use_cache=True, **images)  # step 1
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    cache.reorder_cache(torch.zeros(G, dtype=torch.long, device=device))  # step 2: every layer kind, recurrent too
    logits = out.logits[:, -1].float().expand(G, -1)
    start = int(prompt_positions(vlm.model, prompt, image_id).max()) + 1
    mask = torch.ones(G, len(prompt.ids), dtype=torch.long, device=device)
    tokens, lps = [], []
    done = torch.zeros(G, dtype=torch.bool, device=device)
    for k in range(sampling.max_new_tokens):
        logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
        nxt = logp.argmax(-1) if sampling.greedy else sample_tokens(
            logits, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, generator=gen)
        tokens.append(nxt)
        lps.append(logp.gather(-1, nxt[:, None])[:, 0])
        done |= torch.isin(nxt, torch.tensor(eos, device=device))
        if bool(done.all()) or k + 1 == sampling.max_new_tokens:
            break
        mask = torch.cat([mask, mask.new_ones(G, 1)], dim=1)
        pos = torch.full((family.axes, G, 1), start + k, dtype=torch.long, device=device)  # step 3
        pos = pos[0] if family.axes == 1 else pos
        out = vlm(input_ids=nxt[:, None], position_ids=pos, attention_mask=mask, cache=cache, use_cache=True)
        logits = out.logits[:, -1].float()
    toks = torch.stack(tokens, 1).tolist()
    return toks, list(torch.stack(lps, 1).cpu())
