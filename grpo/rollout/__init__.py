"""Rollout: what samples the G completions of each prompt. `base` (the backend interface: `Sampling`,
`Completions`, `RolloutBackend`), `backends` (the factory), `hf` (our decode loop), `vllm` (an in-process vLLM
engine), `episodes/` (multi-turn: tools and environments). Nothing here is imported by this package's
``__init__``: the tool worker process imports `episodes` without torch."""
