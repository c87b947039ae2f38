"""The one loader of the ``package.module:attr`` names a config holds (reward functions, tools, the environment,
a policy loss): modules beside where the trainer runs are importable, as with ``python -m``."""
from __future__ import annotations

import importlib
import os
import sys

from grpo.errors import ConfigError


def import_attr(module_name: str, attr: str):
    """``getattr(import_module(module_name), attr, None)``; the module's own exception when it fails to import."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # like `python -m`: modules beside where the trainer runs
    return getattr(importlib.import_module(module_name), attr, None)


def load_object(spec: str, key: str):
    """The object ``'package.module:attr'`` names; a one-line ConfigError naming ``key`` when it cannot."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{key}={spec!r} must be 'package.module:name'")
    try:
        obj = import_attr(module_name, attr)
    except Exception as e:  # ImportError, or the module failing on import
        raise ConfigError(f"{key}={spec!r}: cannot import module {module_name!r} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if obj is None:
        raise ConfigError(f"{key}={spec!r}: module {module_name!r} has no {attr!r}")
    return obj
