"""The configuration: `schema` (the typed dataclasses and their checks), `compose` (Hydra composition with the
precedence users expect), `cli` (the command line, checked before Hydra creates anything). Light to import: no
torch, so that a mistake on the command line costs one line."""
