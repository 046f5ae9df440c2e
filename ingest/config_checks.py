"""The checks of ``ingest.config.Config``'s fields: each finds every problem there is and
returns them as messages naming the field, what arrived and how to fix it; the config reports
them together (``ConfigError``).
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Iterable
from typing import Any

from ingest.runtime import RuntimeOptions
from ingest.source_config import SourceConfig

__all__ = ["check_fields", "check_rampup", "did_you_mean", "nearest_divisors",
           "unknown_fields"]

PACKINGS = ("concat", "first_fit", "best_fit", "none")
SHIFTS = ("left", "right")
DEALS = ("units", "row_groups")
LONG_DOCUMENT_POLICIES = ("split", "truncate")
BAD_INPUT_POLICIES = ("error", "skip")
TOKENIZER_NAMES = ("gpt2", "cl100k", "cl100k_base")


def check_fields(cfg: Any) -> tuple[list[str], dict[int, float] | None]:
    """The problems of a ``Config``'s fields, and its ``batch_rampup`` normalized (None when
    there is none or it has problems). ``runtime`` checks its own fields
    (``ingest.runtime.RuntimeOptions``); only how they fit the others is checked here."""
    problems = []
    if not isinstance(cfg.sources, tuple | list) or not cfg.sources:
        problems.append("sources must be a non-empty list of {paths, text_column, weight}")
    else:
        for i, s in enumerate(cfg.sources):
            if not isinstance(s, SourceConfig):
                problems.append(f"sources[{i}] must be a mapping with paths, text_column, weight")
            else:
                problems += s.problems(f"sources[{i}]")
    problems += _tokenizer_problems(cfg)

    def positive_int(name: str, allow_none: bool = False):
        v = getattr(cfg, name)
        if v is None and allow_none:
            return True
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            problems.append(f"{name}={v!r} must be a positive integer"
                            + (" or null" if allow_none else ""))
            return False
        return True

    ok = [positive_int(n) for n in ("seq_len", "global_batch_size", "num_streams",
                                    "packing_bins", "unit_rows")]
    positive_int("num_epochs", allow_none=True)
    if ok[1] and ok[2] and cfg.global_batch_size % cfg.num_streams:
        problems.append(
            f"global_batch_size={cfg.global_batch_size} is not divisible by "
            f"num_streams={cfg.num_streams}; choose num_streams in "
            f"{nearest_divisors(cfg.global_batch_size, cfg.num_streams)}")
    problems += _choice_and_flag_problems(cfg) + _runtime_problems(cfg)
    rampup, rampup_problems = check_rampup(
        cfg.batch_rampup, cfg.global_batch_size if ok[1] else None,
        cfg.num_streams if ok[2] else None)
    return problems + rampup_problems, rampup


def _tokenizer_problems(cfg: Any) -> list[str]:
    problems = []
    if not isinstance(cfg.tokenizer, str) or not (
            cfg.tokenizer in TOKENIZER_NAMES or cfg.tokenizer.endswith(
                (".json", ".tiktoken")) or os.sep in cfg.tokenizer
            or os.path.isdir(cfg.tokenizer)):
        problems.append(f"tokenizer={cfg.tokenizer!r} is unknown; use one of "
                        f"{list(TOKENIZER_NAMES)}, a path to a HF tokenizer.json or to a "
                        f"model folder holding one, or a path to a .tiktoken file")
    if cfg.bos is not None and not isinstance(cfg.bos, bool) and not (
            isinstance(cfg.bos, int) and cfg.bos >= 0):
        problems.append(f"bos={cfg.bos!r} must be false, true (the tokenizer's own "
                        f"beginning-of-document token), a token id >= 0, or null (as the "
                        f"tokenizer's own configuration says)")
    return problems


def _choice_and_flag_problems(cfg: Any) -> list[str]:
    """The fields that take one of a few words, the flags and the other numbers."""
    problems = []
    for name, allowed in (("packing", PACKINGS), ("shift", SHIFTS),
                          ("long_documents", LONG_DOCUMENT_POLICIES),
                          ("on_bad_document", BAD_INPUT_POLICIES), ("deal", DEALS),
                          ("on_bad_file", BAD_INPUT_POLICIES)):
        if getattr(cfg, name) not in allowed:
            problems.append(f"{name}={getattr(cfg, name)!r} must be one of {list(allowed)}")
    for name in ("predict_across_documents", "shuffle", "drop_remainder"):
        if not isinstance(getattr(cfg, name), bool):
            problems.append(f"{name}={getattr(cfg, name)!r} must be true or false")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or cfg.seed < 0:
        problems.append(f"seed={cfg.seed!r} must be an integer >= 0")
    return problems


def _runtime_problems(cfg: Any) -> list[str]:
    """Whether ``runtime`` is a ``RuntimeOptions`` and fits the other fields."""
    rt = cfg.runtime
    if not isinstance(rt, RuntimeOptions):
        return [f"runtime={rt!r} must be an ingest.runtime.RuntimeOptions (e.g. "
                f"runtime=RuntimeOptions(workers=4)); a mapping of runtime options is read by "
                f"Config.from_dict"]
    if rt.reset_after_epoch is True and cfg.num_epochs != 1:
        return [f"reset_after_epoch=true restarts the feed after each pass, which needs "
                f"num_epochs=1 (got num_epochs={cfg.num_epochs!r}); set num_epochs: 1 "
                f"or reset_after_epoch: false"]
    return []


def check_rampup(raw: Any, batch: int | None, streams: int | None
                 ) -> tuple[dict[int, float] | None, list[str]]:
    """``batch_rampup`` normalized (int steps in order, float factors), and its problems."""
    if raw is None:
        return None, []
    if not isinstance(raw, dict) or not raw:
        return None, [f"batch_rampup={raw!r} must be a mapping {{step: factor}} (e.g. "
                      f"{{0: 0.25, 1000: 0.5, 2000: 1.0}}) or null"]
    problems, out = [], {}
    for key, f in raw.items():
        step = key
        if isinstance(key, str) and key.strip().lstrip("+").isdigit():
            step = int(key)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            problems.append(f"batch_rampup={raw!r}: step {key!r} must be an integer >= 0 (the "
                            f"0-based index of a global batch)")
            continue
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f < float("inf"):
            problems.append(f"batch_rampup={raw!r}: the factor at step {step} is {f!r}; give a "
                            f"number > 0 (it multiplies global_batch_size)")
            continue
        if step in out:
            problems.append(f"batch_rampup={raw!r}: step {step} is given twice")
        out[step] = float(f)
    if problems or batch is None or streams is None:
        return None, problems
    unit = streams / batch  # factors that fit are the multiples of this
    bad = []
    for step, f in out.items():
        rows = batch * f
        if abs(rows - round(rows)) > 1e-6 or round(rows) % streams or round(rows) == 0:
            lo, hi = math.floor(rows / streams) * unit, math.ceil(rows / streams) * unit
            near = " or ".join(f"{x:g}" for x in dict.fromkeys((lo, hi)) if x > 0)
            bad.append(f"step {step}: factor {f:g} gives {rows:g} rows (try {near})")
    if bad:
        problems.append(
            f"batch_rampup={raw!r}: global_batch_size={batch} x factor must be a whole number of "
            f"rows divisible by num_streams={streams} at every entry; not at " + "; ".join(bad)
            + f". Factors that fit are the multiples of {unit:g} (num_streams / "
            f"global_batch_size)")
        return None, problems
    return dict(sorted(out.items())), []


def nearest_divisors(n: int, near: int, count: int = 8) -> list[int] | str:
    """The divisors of ``n`` closest to ``near`` (all of them when there are few), ascending;
    found in O(sqrt(n)) steps, so a huge ``n`` is quick."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    divisors = sorted(set(small) | {n // d for d in small})
    if len(divisors) <= count:
        return divisors
    closest = sorted(sorted(divisors, key=lambda d: (abs(d - near), d))[:count])
    return f"the divisors of {n}, e.g. {closest}"


def did_you_mean(key: Any, known: set[str]) -> str:
    """``; did you mean 'x'?`` for the known field closest to an unknown key, or nothing."""
    near = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
    return f"; did you mean {near[0]!r}?" if near else ""


def unknown_fields(mapping: Iterable[Any], known: set[str], where: str = "") -> list[str]:
    """A problem for each key of ``mapping`` that is not a ``known`` field, with the closest
    known one suggested; ``where`` (``sources[0]``) leads each message."""
    lead = f"{where}: " if where else ""
    return [f"{lead}unknown field {k!r}{did_you_mean(k, known)}; known fields: "
            f"{sorted(known)}" for k in mapping if k not in known]
