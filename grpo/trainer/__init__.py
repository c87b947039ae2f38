"""The trainer: the entry point's loop (`loop.fit`), the run it builds once (`build`, `run`, `budget`), what it
writes to disk (`checkpoint`, `signals`, `logger`, `report`) and the held-out evaluation (`evaluate`)."""
