"""A dropped rollout server taken back once it restarted (``rollout.server.rejoin_every_s``; several servers).

Before the push of each version (`grpo.rollout.server.backend.ServerBackend.push`, every rank at the same point),
rank 0 probes the run's servers that are out of its pool, at most every ``every_s`` seconds, each one cheaply and
bounded: ``GET /health`` (2 s, no retry), then its weight label (``GET /weight_info``, 5 s):

- no label of any run (a fresh vLLM says ``default``): it **restarted**. It is checked as at connect (the model, the
  max length: `check_server`), joins a weight channel of its own, and goes back into every rank's pool just before
  the push, so that push gives it the version's weights and labels them ``VERSION@RUN`` and the sync check checks it
  before any request of the version: a rejoined server never samples with other weights (its label is asked after
  every call, as every server's). ``server ... rejoined at version V`` is said once the check has passed.
- another run's label (``VERSION@OTHER``): another trainer took it over; it never rejoins (said once).
- this run's label: it did not restart (it hung, or failed its check); it stays out.

Syncing LoRA adapters (``rollout.vllm.lora_sync=adapters``) no server rejoins: the snapshot of a version holds the
adapter only, not the base weights a fresh server needs (merged weights rejoin as above).
"""
from __future__ import annotations

import time

from grpo.rollout.server.client import ServerError

PROBE_S = 2.0  # ``/health`` of a dropped server: at most this long, no retry


class Rejoiner:
    """Rank 0's probes of dropped servers; ``every_s``: seconds between two rounds (0: before every push);
    ``say``: one line to the console."""

    def __init__(self, every_s: float, say):
        self.every_s, self.say = every_s, say
        self.last = float("-inf")
        self.said: set[str] = set()  # servers whose refusal was said (once each)

    def due(self) -> bool:
        if time.monotonic() - self.last < self.every_s:
            return False
        self.last = time.monotonic()
        return True

    def restarted(self, server, run_id: str) -> bool:
        """Whether ``server`` answers and holds no run's weights (a fresh process); another run's label is said."""
        if not server.up(timeout_s=PROBE_S):
            return False
        try:
            held = (server.get("/weight_info", timeout_s=5.0, retries=0) or {}).get("weight_version")
        except ServerError:
            return False
        if held is None or "@" not in str(held):
            return True
        if str(held).split("@", 1)[1] != run_id and server.url not in self.said:
            self.said.add(server.url)
            self.say(f"rollout server {server.url} is up again but holds another run's weights ({held!r}): another "
                     "trainer took it over, so it does not rejoin this run")
        return False

    def refused(self, server, why: str) -> None:
        if server.url not in self.said:
            self.said.add(server.url)
            self.say(f"rollout server {server.url} restarted but cannot rejoin: {why}")
