"""The sampling a model's authors suggest, from its generation_config.json.

`smoe chat` uses it when --temp/--top-p are not given, as transformers' generate() does:
the demo (and Qwen3) ship do_sample with a temperature and top_p. The file is untrusted
input: a value that is missing, of the wrong type or out of range is ignored, and without
do_sample the suggestion is greedy decoding.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

GREEDY = {"temperature": 0.0, "top_p": 1.0}


def _number(config: dict[str, Any], key: str, low: float, high: float, default: float) -> float:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    return float(value) if math.isfinite(value) and low <= value <= high else default


def suggested_sampling(model_dir: Path) -> dict[str, float]:
    """{'temperature', 'top_p'} from model_dir/generation_config.json; greedy when absent."""
    return sampling_and_origin(model_dir)[0]


def sampling_and_origin(model_dir: Path) -> tuple[dict[str, float], str]:
    """``suggested_sampling`` and where it came from, in words for the start line: the
    model's own suggestion only where its generation_config.json asks to sample."""
    try:
        config = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return dict(GREEDY), "greedy: the model suggests none, having no generation_config.json"
    if not isinstance(config, dict) or config.get("do_sample") is not True:
        return dict(GREEDY), "greedy: the model's generation_config.json does not sample"
    suggested = {
        "temperature": _number(config, "temperature", 0.0, 10.0, 1.0),
        "top_p": _number(config, "top_p", 0.0, 1.0, 1.0) or 1.0,
    }
    return suggested, "the model's suggestion, from its generation_config.json"
