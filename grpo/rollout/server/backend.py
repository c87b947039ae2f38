"""``rollout.backend=server``: the completions come from vLLM's own OpenAI-compatible servers (`grpo-serve`).

1. **Connect** (at the first rollout): wait for every server's ``/health``; ask each what it serves
   (``/collective_rpc`` -> `GRPOWorkerExtension.grpo_model_info`) and refuse, in one line, a server of another
   model or a shorter max length; join the weight channel; push the trainer's weights.
2. **Generate**: each group is one ``/v1/completions`` request (``n = G`` samples of one prompt given as token
   ids), sent concurrently, a whole group on one server (`ServerPool.pick`); token ids and the sampler's
   log-probs come back. Every group records the weight version that produced it (`Completions.versions`).
3. **Sync** after every optimizer step (or every ``sync_every``): rank 0 streams the weights (each gathered on
   its own under ZeRO-3, LoRA merged: `grpo.rollout.weights.hf_weights`; or the base weights once and then each
   version's adapters: `grpo.rollout.server.adapters`) through the gloo channel
   (`grpo.runtime.transfer`) into the server's in-place ``reload_weights`` (``grpo_receive``), or vLLM's nccl
   transfer on GPUs (`grpo.rollout.server.nccl`); then ``/reset_prefix_cache`` and ``/update_weight_version``.
4. **Check** the sync: the server's prompt log-probs of a fixed sequence against the trainer's own; a gap above
   ``sync_check_tol`` stops the run with one line (a server sampling from stale weights would look plausible).
5. **Faults**: every push labels the weights ``VERSION@RUN`` (``RUN`` a random id of this backend); after every
   call's groups have come back each server that answered one is asked its label (``GET /weight_info``), so a
   server that restarted (its label gone) or that another trainer took over is never trained against with other
   weights. A server that stops answering (refused, reset, past ``request_timeout_s``), fails its push or its
   check, or restarted is dropped from the pool (`ServerPool.drop`, said once, ``server/servers_up``) and its
   groups are asked again of the others, with the same seeds; the last server's loss stops the run in one line.
   A dropped server that restarted rejoins before a later push (`grpo.rollout.server.rejoin`).
"""
from __future__ import annotations

import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from grpo.errors import SetupError
from grpo.rollout.base import Completions, Sampling, cut_at_eos, trainer_logprobs
from grpo.rollout.lora_sync import Adapter, adapter_state
from grpo.rollout.server.adapters import ServerAdapters, connect_adapters
from grpo.rollout.server.client import (
    RESUME,
    ServerDown,
    ServerError,
    ServerPool,
    group_request,
    model_info,
    parse_group,
    prompt_logprobs,
)
from grpo.rollout.server.gloo import GlooTransfer
from grpo.rollout.server.images import GENERATE, frozen_tower, image_request, parse_generate, vision_inputs
from grpo.rollout.server.rejoin import Rejoiner
from grpo.rollout.vllm_images import VLLM_VISION_FAMILIES
from grpo.rollout.weights import as_they_are, counted, hf_weights


class ServerBackend:
    def __init__(self, model, pool: ServerPool, *, model_name: str, facts: dict, eos_ids: list[int],
                 max_model_len: int, check_ids: list[int], tol: float = 1e-3, sync_every: int = 1,
                 transfer=None, full_weights=None, rank: int = 0, barrier=None, all_max=None, device="cpu",
                 lora_sync: str = "auto", lora_keep: int = 1, rejoin_every_s: float | None = None):
        """``transfer``: the weight sender (`GlooTransfer`, `grpo.rollout.server.nccl.NCCLTransfer`), None on a
        rank that does not send. ``barrier``/``all_max``: the runtime's collectives (several training processes:
        every rank syncs, rank 0 sends); ``facts``: `model_facts` of the trainer's model; ``lora_sync``,
        ``lora_keep``: LoRA's sync (rollout.vllm.lora_sync) and the adapter versions kept resident;
        ``rejoin_every_s``: how often a dropped server is probed (`grpo.rollout.server.rejoin`; None: never)."""
        self.pool, self.model_name, self.eos_ids = pool, model_name, list(eos_ids)
        self.vision = vision_inputs(model)  # (image token, merge, the trainer's tower) of a vision-language model
        self.facts, self.max_model_len = facts, max_model_len  # what a rejoining server is checked against
        # the sync check scores text: a prompt's image tokens have no image there (as the in-process backend's)
        self.check_ids = [t for t in check_ids if self.vision is None or t != self.vision[0]]
        self.tol, self.sync_every = tol, sync_every
        self.transfer, self.full_weights, self.rank = transfer, full_weights, rank
        self.barrier, self.all_max, self.device = barrier or (lambda: None), all_max, device
        self.version: int | None = None     # the weight version the servers hold (None: not pushed yet)
        self.urls = [s.url for s in pool.servers]  # the run's servers, dropped or not (every rank names them all)
        # in every label, so weights another trainer pushed never pass as ours; one id for all ranks (the largest draw)
        token = float(secrets.randbelow(2 ** 48))
        self.run_id = f"{int(all_max({'run_id': token})['run_id'] if all_max else token):012x}"
        self.metrics: dict[str, float] = {"server/servers_up": float(len(pool.servers))}
        pool.wait_until_up()
        infos = [check_server(s, model_name, facts, max_model_len) for s in pool.servers]
        self.adapters: ServerAdapters | None = connect_adapters(
            model, pool.servers, infos, lora_sync, lora_keep,
            gloo=isinstance(transfer, GlooTransfer) or transfer is None, say=pool.say)
        if transfer is not None:
            transfer.connect(pool.servers)
        several = len(self.urls) > 1 and self.adapters is None and rejoin_every_s is not None
        self.rejoiner = Rejoiner(rejoin_every_s, pool.say) if several else None
        self.rejoined: list[str] = []  # servers back in the pool for the push under way (said after its check)

    # ------------------------------------------------------------------------------------ weights
    def sync_weights(self, model, version: int) -> None:
        """Push the weights, labelled ``version`` (the trainer's optimizer step count), when ``sync_every`` steps
        have passed since the last push (always the first time), then check the sync. Every training rank calls it
        at the same point."""
        v = int(version)
        self.metrics["server/version_lag"] = float(v - (self.version if self.version is not None else v))
        if self.version is not None and v - self.version < self.sync_every:
            self.metrics["time/sync_s"] = 0.0
            return
        with torch.no_grad():  # not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
            t0 = time.time()
            self.push(self.weights(model), v)
            self.metrics.update({"time/sync_s": time.time() - t0, "server/version_lag": 0.0})
            self.check(model)

    def weights(self, model):
        """What a push of ``model`` sends: its adapter (`Adapter`), after the base weights have gone once (pushed
        here), or every weight (LoRA merged) as a stream."""
        kw = {"full_weights": self.full_weights} if self.full_weights else {}
        if self.adapters is None:
            return hf_weights(model, **kw)
        if not self.adapters.base_loaded:
            self.push(hf_weights(model, merge=False, **kw), self.version if self.version is not None else -1)
            self.adapters.base_loaded = True
        return adapter_state(model, self.full_weights or as_they_are)

    def served(self) -> str:
        """The model name requests give: the adapter of the version the servers hold, or the base model."""
        if self.adapters is None or self.version is None:
            return self.model_name
        return self.adapters.served(self.model_name, self.version)

    def stats(self) -> dict[str, float]:
        """This step's sync (`sync_weights`: its time and version lag) and the last sync check's gap."""
        return dict(self.metrics)

    def label(self, version: int | None) -> str:
        """What a server reports (``/weight_info``) once it holds ``version`` of this run's weights."""
        return f"{version}@{self.run_id}"

    def push(self, weights, version: int) -> None:
        """Stream ``weights`` ((HF name, tensor) pairs) into every server and label them ``version``. The
        asynchronous generator (`grpo.rollout.server.generator_thread`) calls it with a snapshot, then `check` with the
        trainer's log-probs of that snapshot. A server that loses its push is dropped (every rank drops it)."""
        if isinstance(weights, Adapter):
            self.metrics.update({"sync/bytes": float(weights.nbytes), "sync/adapters": 1.0})
            failed: dict[str, str] = {}
            if self.transfer is not None:
                failed = self.adapters.push(weights, version, self.transfer, self.pool.servers, self.model_name)
                failed.update(self._label(version, [s for s in self.pool.servers if s.url not in failed],
                                          prefix_cache=False))
            self.barrier()
            self._drop_everywhere(failed, "failed its adapter push")
            self.version = version
            return
        self._rejoin()
        sent: dict = {}
        skip = self._frozen_tower()
        if skip:
            weights = ((n, t) for n, t in weights if skip not in n)
        weights, failed = counted(weights, sent), {}
        try:
            if self.transfer is not None:
                failed = dict(self.transfer.send(weights, self.pool.servers, **({"args": [skip]} if skip else {})))
                failed.update(self._label(version, [s for s in self.pool.servers if s.url not in failed]))
            else:  # another rank sends; ZeRO-3 gathers each weight on every rank together
                for _ in weights:
                    pass
        finally:
            weights.close()
            self.metrics.update({"sync/bytes": float(sent["bytes"]), "sync/adapters": 0.0})
        self.barrier()  # no rank samples before rank 0's push is done
        self._drop_everywhere(failed, "failed its weight push")
        self.version = version

    def _frozen_tower(self) -> str:
        """What the weights of a frozen vision tower are named by (``visual.``) once the servers hold it (after this
        backend's first push, gloo channel): a push then leaves them out; "" when everything goes."""
        if self.vision is None or self.version is None or not isinstance(self.transfer, GlooTransfer) or \
                self.rejoined:  # a server back from a restart holds no tower yet
            return ""
        return "visual." if frozen_tower(self.vision) else ""

    def _rejoin(self) -> None:
        """Before a push, on every rank: the dropped servers that restarted back into the pool (rank 0 probes and
        reconnects them, `grpo.rollout.server.rejoin`; every rank takes them back), so the push gives them the
        version's weights before any request."""
        if self.rejoiner is None:
            return
        up = {s.url for s in self.pool.servers}
        out = [s for s in self.pool.known if s.url not in up]
        back = [s.url for s in out if self._reconnect(s)] if self.transfer is not None and out and \
            self.rejoiner.due() else []
        if self.all_max is not None:
            agreed = self.all_max({u: float(u in back) for u in self.urls})
            back = [u for u in self.urls if agreed[u] > 0]
        for url in back:
            self.pool.add(url)
        self.rejoined = back
        self.metrics["server/servers_up"] = float(len(self.pool.servers))

    def _reconnect(self, server) -> bool:
        """Rank 0: whether ``server`` restarted, passes the connect checks and has joined a weight channel."""
        if not self.rejoiner.restarted(server, self.run_id):
            return False
        try:
            check_server(server, self.model_name, self.facts, self.max_model_len)
            self.transfer.connect([server])
        except ServerError as e:
            self.rejoiner.refused(server, str(e))
            return False
        return True

    def _label(self, version: int, servers, prefix_cache: bool = True) -> dict[str, str]:
        """Label ``servers``' weights ``version`` (and drop their cached prompt K/V, which belong to the old
        weights; an adapter version has its own cache); returns {url: why} of those that went down meanwhile."""
        failed = {}
        for s in servers:
            try:
                if prefix_cache:
                    s.post("/reset_prefix_cache")
                if prefix_cache and self.vision is not None:  # vLLM's reload emptied its worker's encoder cache,
                    s.post("/reset_encoder_cache")            # not its scheduler's record of it: both, or a miss
                s.post("/update_weight_version", {"new_version": self.label(version)})
            except ServerDown as e:
                failed[s.url] = str(e)
        return failed

    def _drop_everywhere(self, failed: dict[str, str], what: str) -> None:
        """Drop the servers of ``failed`` ({url: why}, this rank's) on every rank (``what``: said where another
        rank saw it)."""
        if self.all_max is not None:
            agreed = self.all_max({u: float(u in failed) for u in self.urls})
            failed = {u: failed.get(u, f"rollout server {u} {what} on another rank; {RESUME}")
                      for u in self.urls if agreed[u] > 0}
        for url, why in failed.items():
            self.pool.drop(url, why)
        self.metrics["server/servers_up"] = float(len(self.pool.servers))

    def check(self, model=None, mine: torch.Tensor | None = None) -> float:
        """The largest |log p_server - log p_trainer| over the check sequence's tokens and every server; above
        ``tol`` on every server: `ServerError` (the run stops with one line); on some of several: those are dropped.
        ``mine``: the trainer's log-probs of the pushed weights (`trainer_logprobs`) when ``model`` no longer holds
        them."""
        ids = self.check_ids
        mine = trainer_logprobs(model, ids, self.device) if mine is None else mine
        gaps, failed = {}, {}
        for s in self.pool.servers:
            body = {"model": self.served(), "prompt": ids, "max_tokens": 1, "temperature": 1.0,
                    "prompt_logprobs": 0, "return_token_ids": True}
            try:
                theirs = torch.tensor(prompt_logprobs(s.post("/v1/completions", body), ids))
            except ServerDown as e:
                failed[s.url] = str(e)
                continue
            g = float((theirs - mine).abs().max()) if len(theirs) else 0.0
            gaps[s.url] = float("inf") if g != g else g  # NaN counts as the worst
        if self.all_max is not None:
            theirs = self.all_max({u: gaps.get(u, 0.0) for u in self.urls})
            gaps = {u: theirs[u] for u in gaps}
        bad = {u: g for u, g in gaps.items() if g > self.tol}
        for url, g in bad.items():
            failed[url] = (f"weight sync check failed: rollout server {url} scores the check sequence {g:.3g} away "
                           f"from the trainer (rollout.server.sync_check_tol={self.tol:g}) after pushing weight "
                           f"version {self.version}: it does not sample from the trainer's policy")
        if bad and len(bad) == len(gaps):  # no server agrees with the trainer: the trainer's side is suspect
            self.metrics["server/sync_logprob_gap"] = max(bad.values())
            raise ServerError(failed[max(bad, key=bad.get)])
        self._drop_everywhere(failed, "failed the weight sync check")
        for url in [u for u in self.rejoined if u in {s.url for s in self.pool.servers}]:
            self.pool.say(f"rollout server {url} rejoined at version {self.version}: {len(self.pool.servers)} of "
                          f"{self.pool.started} rollout servers up")
        self.rejoined = []
        gap = max((g for u, g in gaps.items() if u not in bad), default=0.0)
        self.metrics["server/sync_logprob_gap"] = gap
        return gap

    # ------------------------------------------------------------------------------------ sampling
    def generate(self, prompt_ids, group_size, sampling: Sampling, seed=None, suffixes=None) -> Completions:
        from grpo.rollout.hf import flatten, regroup

        if suffixes is not None and any(getattr(p, "n_images", 0) for p in prompt_ids):
            raise SetupError("multi-turn episodes (rollout.tools / rollout.environment) do not take image prompts yet")
        if suffixes is not None:  # each prompt + suffix is a one-sample request
            out = self.generate(flatten(prompt_ids, suffixes), 1, sampling, seed)
            flat = [[g[0] for g in x] for x in (out.ids, out.truncated, out.logprobs)]
            return Completions(*(regroup(x, suffixes) for x in flat), versions=[self.version] * len(prompt_ids))
        # one seed per group: the server seeds a group's G samples seed, seed + 1, ...
        bodies = [self._request(p, group_request(self.served(), p, group_size, sampling, self.eos_ids,
                                                 None if seed is None else seed + i * group_size))
                  for i, p in enumerate(prompt_ids)]
        answers = self._all_groups(bodies)
        ids, truncated, logps = [], [], []
        for toks, lps in answers:
            gi, gt, gl = [], [], []
            for t, lp in zip(toks, lps):
                kept, cut = cut_at_eos(t, self.eos_ids, sampling.max_new_tokens)
                gi.append(kept)
                gt.append(cut)
                gl.append(torch.tensor(lp[:len(kept)], dtype=torch.float32))
            ids.append(gi)
            truncated.append(gt)
            logps.append(gl)
        return Completions(ids, truncated, logps, versions=[self.version] * len(prompt_ids))

    def _request(self, prompt, body: dict) -> tuple:
        """(route, body, prompt) of one group: ``/v1/completions`` for a text prompt, vLLM's tokens-in route with the
        images' features for a prompt with images (`grpo.rollout.server.images`)."""
        if not getattr(prompt, "n_images", 0):
            return "/v1/completions", body, None
        if self.vision is None:
            raise ServerError(f"rollout.backend=server takes images for {', '.join(VLLM_VISION_FAMILIES)} models "
                              "only; use rollout.backend=hf for this one")
        image_id, merge, tower = self.vision
        return GENERATE, image_request(body, prompt, image_id, tower, merge), list(prompt)

    def _all_groups(self, bodies: list[tuple]) -> list:
        """Every group's answer, each from a server that held this run's current weights when it answered: the
        servers that answered are asked their label afterwards, and the groups of one that restarted (or was taken
        over) are asked again of the others, as are those of a server that stopped answering."""
        answers: list = [None] * len(bodies)
        todo = list(range(len(bodies)))
        while todo:
            with ThreadPoolExecutor(max_workers=max(1, min(len(todo), 64))) as ex:
                got = list(ex.map(lambda i: self._one_group(bodies[i]), todo))
            by = {}
            for i, (url, answer) in zip(todo, got):
                answers[i] = answer
                by.setdefault(url, []).append(i)
            wrong = self._relabelled(list(by))
            for url, why in wrong.items():
                self.pool.drop(url, why)
            self.metrics["server/servers_up"] = float(len(self.pool.servers))
            todo = sorted(i for url in wrong for i in by[url])
        return answers

    def _relabelled(self, urls: list[str]) -> dict[str, str]:
        """{url: why} of the servers among ``urls`` that no longer hold this run's current weights."""
        if self.version is None:  # nothing pushed yet (a backend used before its first sync)
            return {}
        want, out = self.label(self.version), {}
        for s in [s for s in self.pool.servers if s.url in urls]:
            try:
                held = (s.get("/weight_info") or {}).get("weight_version")
            except ServerDown as e:
                out[s.url] = str(e)
                continue
            if held != want:
                out[s.url] = (f"rollout server {s.url} restarted or was taken over: it holds weights {held!r}, not "
                              f"this run's version {want!r}, so its samples were not used; {RESUME}")
        return out

    def _one_group(self, request: tuple):
        """(the url of the server that answered, its answer) of a `_request`; a server that stops answering is
        dropped and the group asked of another."""
        path, body, prompt = request
        while True:
            s = self.pool.pick()
            try:
                answer = s.post(path, body)
                return s.url, parse_group(answer) if prompt is None else parse_generate(answer, prompt)
            except ServerDown as e:
                self.pool.drop(s.url, str(e))
            finally:
                self.pool.done(s)

    def sleep(self) -> None:  # the servers keep their memory
        pass

    def close(self) -> None:
        """Leave the servers running (another trainer may take them over); drop the weight channel."""
        if self.transfer is not None:
            self.transfer.close()


def check_server(server, model_name: str, facts: dict, max_model_len: int) -> dict:
    """Refuse, in one line, a server that serves another model or a shorter max length than the run needs; returns
    its `model_info` (the LoRA check reads it too)."""
    models = server.get("/v1/models")["data"]
    served = {m["id"]: m for m in models}
    if model_name not in served:
        raise ServerError(f"rollout server {server.url} serves {', '.join(served) or 'nothing'}, not {model_name!r}; "
                          "start it with grpo-serve and the run's recipe")
    theirs = model_info(server)
    differ = [f"{k}={theirs.get(k)!r} (the trainer's {v!r})" for k, v in facts.items() if theirs.get(k) != v]
    if differ:
        raise ServerError(f"rollout server {server.url} serves another model than the trainer's: {differ[0]}; "
                          "start it with grpo-serve and the run's recipe")
    length = served[model_name].get("max_model_len") or theirs.get("max_model_len") or 0
    if length < max_model_len:
        raise ServerError(f"rollout server {server.url} has max_model_len={length}, the run needs {max_model_len} "
                          "(its longest prompt + rollout.max_new_tokens); start it with grpo-serve and the run's "
                          "recipe or a larger rollout.vllm.max_model_len")
    return theirs
