"""``knorm-batch --job FILE``: a job file's keys, checked against the same field tables as the
options (``[eviction]``, ``[generation]``, ``[rows]``), its paths resolved against its folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

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


def _path(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError
    return _expand(value)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError
    return value


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError
    return value


def _token(value: Any) -> bool:
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def _tokens(value: Any) -> tuple[str, ...]:
    tokens = [value] if _token(value) else value
    if not isinstance(tokens, list) or not all(_token(t) for t in tokens):
        raise ValueError
    return tuple(str(t) for t in tokens)


def _patterns(value: Any) -> tuple[str, ...]:
    globs = [value] if isinstance(value, str) else value
    if not isinstance(globs, list) or not globs or not all(isinstance(g, str) and g.strip() for g in globs):
        raise ValueError
    return tuple(globs)


_PATH = (_path, "a path string")
_INTEGER = (_integer, "an integer")
RUN_FIELDS: dict[str, tuple[Callable[[Any], Any], Optional[str]]] = {
    "input": _PATH, "output": _PATH, "model": (_text, "text"), "batch_size": _INTEGER, "stats_log": _PATH,
    "summary_json": _PATH, "texts": _PATH, "limit": _INTEGER,
    "max_kv_memory": (parse_size, None),
    "extra_eos_tokens": (_tokens, "a token or a list of tokens (text or ids)"),
    "chat_template_config": (parse_template_config, None),
    "adapter_path": _PATH, "trust_remote_code": (_flag, "true or false"),
    "glob": (_patterns, 'a file name pattern or a list of them, such as ["*.md", "*.txt"]'), "calibrate": _INTEGER,
}
"""The job file's top-level keys, each with what turns its value into the run's (a ValueError:
not that) and what the value must be, in words (None: the ValueError says it, as the parsers of
the options ``--max-kv-memory`` and ``--chat-template-config`` do, which these keys share)."""

RUN_KEYS = tuple(RUN_FIELDS)
JOB_KEYS = {None: RUN_KEYS, "eviction": EVICTION_FIELDS + ("preset",), "generation": GENERATION_FIELDS,
            "rows": ROWS_FIELDS}
JOB_PATHS = tuple(key for key, field in RUN_FIELDS.items() if field is _PATH)


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
    """Each top-level key of ``flat`` as :data:`RUN_FIELDS` turns it; a path relative to the job file's folder."""
    job_dir = Path(path).expanduser().parent
    for key in RUN_KEYS:
        if key in flat:
            flat[key] = _run_value(path, key, flat[key])
            if key in JOB_PATHS and flat[key] != "-" and not Path(flat[key]).is_absolute():
                flat[key] = os.path.normpath(job_dir / flat[key])


def _run_value(path: str, key: str, value: Any) -> Any:
    """``value`` as :data:`RUN_FIELDS` turns it; UsageFailure names the file, the key, what it must be and the value."""
    parse, what = RUN_FIELDS[key]
    try:
        return parse(value)
    except ValueError as e:
        said = f"'{key}' must be {what}, got {value!r}" if what else f"'{key}': {e}"
        raise UsageFailure(f"job file {path}: {said}") from None


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
