"""``knorm-batch --job FILE``: a job file's keys, checked against the same field tables as the
options (``[eviction]``, ``[generation]``, ``[rows]``), its paths resolved against its folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from ..eviction.config import (
    EVICTION_FIELDS,
    GENERATION_FIELDS,
    LAYOUT_FIELDS,
    ROWS_FIELDS,
    EvictionConfig,
    GenerationConfig,
    RowsConfig,
    make_configs,
)
from ..eviction.legacy import current_settings
from ..generation.admission import parse_size
from .options import CONFIG_FIELDS, OPTION_FIELDS, ROW_SHAPE_FIELDS, UsageFailure, parse_template_config

RUN_KEYS = ("input", "output", "model", "batch_size", "stats_log", "summary_json", "texts", "limit", "max_kv_memory",
            "extra_eos_tokens", "chat_template_config", "adapter_path", "trust_remote_code", "glob", "calibrate")
JOB_KEYS = {None: RUN_KEYS, "eviction": EVICTION_FIELDS + ("preset",), "generation": GENERATION_FIELDS,
            "rows": ROWS_FIELDS}
JOB_PATHS = ("input", "output", "stats_log", "summary_json", "texts", "adapter_path")
def _expand(path: str) -> str:
    return path if path == "-" else os.path.expanduser(path)


def _read_toml(path: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise UsageFailure("job files need Python 3.11+ or the 'tomli' package (pip install tomli)") from None
    try:
        return tomllib.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageFailure(f"cannot read job file {path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageFailure(f"job file {path} is not valid TOML: {e}") from None


def _key_hint(key: str) -> str:
    if key in ("max_kv_size", "max-kv-size"):
        return "; the per-layer token budget is budget = N under [eviction] (mlx_lm's max_kv_size has no equivalent)"
    return ""


def _flatten_job(path: str, data: dict) -> dict:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in JOB_KEYS and key is not None and isinstance(value, dict):
            for sub, subvalue in value.items():
                if sub not in JOB_KEYS[key]:
                    raise UsageFailure(f"job file {path}: unknown key '{sub}' in [{key}]; "
                                       f"allowed: {', '.join(JOB_KEYS[key])}{_key_hint(sub)}")
                flat[sub] = subvalue
        elif key in RUN_KEYS:
            flat[key] = value
        else:
            allowed = ", ".join(RUN_KEYS) + ", [eviction], [generation], [rows]"
            raise UsageFailure(f"job file {path}: unknown key '{key}'; allowed: {allowed}{_key_hint(key)}")
    return flat


def _check_run_keys(path: str, flat: dict) -> None:
    job_dir = Path(path).expanduser().parent
    for key in JOB_PATHS:
        if key in flat:
            if not isinstance(flat[key], str) or not flat[key]:
                raise UsageFailure(f"job file {path}: '{key}' must be a path string")
            value = _expand(flat[key])
            if value != "-" and not Path(value).is_absolute():
                value = os.path.normpath(job_dir / value)
            flat[key] = value
    if "model" in flat and not isinstance(flat["model"], str):
        raise UsageFailure(f"job file {path}: 'model' must be text, got {flat['model']!r}")
    for key in ("limit", "batch_size", "calibrate"):
        if key in flat and (isinstance(flat[key], bool) or not isinstance(flat[key], int)):
            raise UsageFailure(f"job file {path}: '{key}' must be an integer, got {flat[key]!r}")
    if "max_kv_memory" in flat:
        try:
            flat["max_kv_memory"] = parse_size(flat["max_kv_memory"])
        except ValueError as e:
            raise UsageFailure(f"job file {path}: max_kv_memory: {e}") from None
    if "extra_eos_tokens" in flat:
        tokens = flat["extra_eos_tokens"]
        tokens = [tokens] if isinstance(tokens, (str, int)) and not isinstance(tokens, bool) else tokens
        if not isinstance(tokens, list) or not all(isinstance(t, (str, int)) and not isinstance(t, bool)
                                                   for t in tokens):
            raise UsageFailure(f"job file {path}: 'extra_eos_tokens' must be a list of tokens (text or ids), "
                               f"got {flat['extra_eos_tokens']!r}")
        flat["extra_eos_tokens"] = tuple(str(t) for t in tokens)
    if "chat_template_config" in flat:
        try:
            flat["chat_template_config"] = parse_template_config(flat["chat_template_config"])
        except ValueError as e:
            raise UsageFailure(f"job file {path}: {e}") from None
    if "glob" in flat:
        globs = [flat["glob"]] if isinstance(flat["glob"], str) else flat["glob"]
        if not isinstance(globs, list) or not globs or not all(isinstance(g, str) and g.strip() for g in globs):
            raise UsageFailure(f"job file {path}: 'glob' must be a file name pattern or a list of them, such as "
                               f"[\"*.md\", \"*.txt\"], got {flat['glob']!r}")
        flat["glob"] = tuple(globs)
    if "trust_remote_code" in flat and not isinstance(flat["trust_remote_code"], bool):
        raise UsageFailure(f"job file {path}: 'trust_remote_code' must be true or false, "
                           f"got {flat['trust_remote_code']!r}")


def load_job(path: str) -> dict:
    """A job file's settings as a flat dict. Paths: ``~`` is expanded (environment
    variables are not), and relative paths resolve against the file's folder.
    Config values in text form (``budget = "none"``, ``skip_layers = "0-8"``) are
    parsed by their field's parser and every value is checked by the configs."""
    flat = current_settings(_flatten_job(path, _read_toml(path)))
    _check_run_keys(path, flat)
    try:
        for key, value in flat.items():
            parse = OPTION_FIELDS[key].metadata.get("parse") if key in OPTION_FIELDS else None
            if parse:
                flat[key] = parse(value)
        build_configs(flat)
        rows_config(flat)
    except ValueError as e:
        raise UsageFailure(f"job file {path}: {e}") from None
    return flat


def auto_layout(settings: dict) -> Optional[tuple]:
    """With ``--preset auto``, the layout fields given beside it (they win over the
    saved tuning); None without it."""
    if settings.get("preset") != "auto":
        return None
    return tuple(k for k in LAYOUT_FIELDS if settings.get(k) is not None)


def build_configs(settings: dict) -> tuple[EvictionConfig, GenerationConfig]:
    """The two configs from flat settings (missing fields take their defaults)."""
    return make_configs(preset=settings.get("preset"), **{k: v for k, v in settings.items() if k in CONFIG_FIELDS})


def rows_config(settings: dict) -> RowsConfig:
    """How rows are read, from flat settings."""
    return RowsConfig(**{k: v for k, v in settings.items() if k in ROW_SHAPE_FIELDS})
