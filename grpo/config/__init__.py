"""The configuration: `schema` (the typed dataclasses and their checks), `compose` (Hydra composition with the
precedence users expect). Light to import: no torch, and nothing of the stages (the command line that checks a run
with them is `grpo.cli`, an entry point), so that a mistake on the command line costs one line."""
