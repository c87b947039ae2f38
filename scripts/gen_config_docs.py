#!/usr/bin/env python
"""Regenerate docs/config-reference.md from grpo/config.py, configs/ and recipes/ (`--check`: only compare).

    python scripts/gen_config_docs.py
    python scripts/gen_config_docs.py --check
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grpo.config_docs import main  # noqa: E402

if __name__ == "__main__":
    main()
