"""What a TRL or verl user types, said in our terms where it is refused (docs/coming-from-trl-verl.md has the whole
mapping): their value of a choice of ours names our value; a key of theirs with no equivalent says why, instead of
a key of ours with a close name that means something else."""
from __future__ import annotations

# what a TRL or verl user types for a choice of ours: refused, naming ours (docs/coming-from-trl-verl.md)
THEIRS = {
    "algorithm.kl_estimator": {"low_var_kl": ("k3", "verl's"), "kl": ("k1", "verl's"), "mse": ("k2", "verl's")},
    "algorithm.scale_rewards": {"false": ("none", "TRL's"), "true": ("group", "TRL's")},
}
# keys of theirs we have no equivalent of: why, instead of a close name that means something else
NOT_HERE = {
    "rollout.min_p": "min-p sampling is not supported; rollout.top_p and rollout.top_k are",
    "rollout.repetition_penalty": "not a sampling option here: a reward, "
                                  "'+reward.functions.rep={fn: repetition_penalty, weight: 0.5}'",
}


def ours_for(key: str, value) -> str:
    """The tail of the refusal of ``key=value``: our value, when ``value`` is another trainer's for it."""
    theirs = str(value).lower()
    hit = THEIRS.get(key, {}).get(theirs)  # (ours, whose)
    return f"; {hit[1]} {theirs} is {key}={hit[0]} here" if hit else ""
