"""Load, merge and validate workflow configs against config/schema.yaml.

Used by the Snakefile (through rules/common.smk) before any job runs, and by
``python -m cramswarm check-config``. Errors name the offending key as a dotted path
(``tokenizer.vocab_sizes[0]``) and, for enumerations and unknown keys, the allowed values.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterable

import yaml
from jsonschema import Draft202012Validator, validators

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SCHEMA = REPO_ROOT / "config" / "schema.yaml"


class ConfigError(ValueError):
    """An invalid workflow configuration; the message lists every problem found."""


def _with_defaults(base):
    """A validator class that fills in schema ``default`` values while it validates."""
    validate_properties = base.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return validators.extend(base, {"properties": set_defaults})


_Validator = _with_defaults(Draft202012Validator)


def key_path(path: Iterable[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"


def _describe(error) -> str:
    where = key_path(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = sorted(error.schema.get("properties", {}))
        unknown = sorted(set(error.instance) - set(allowed))
        prefix = "" if where == "<top level>" else where + "."
        names = ", ".join(repr(prefix + u) for u in unknown)
        return f"unknown config key {names}; allowed keys here: {', '.join(allowed)}"
    if error.validator == "enum":
        return f"config key '{where}': {error.instance!r} is not allowed; allowed values: {', '.join(map(str, error.validator_value))}"
    return f"config key '{where}': {error.message}"


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at its top level")
    return data


def deep_merge(base: dict, overlay: dict) -> dict:
    """Overlay ``overlay`` on ``base`` the way Snakemake merges several --configfile files."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _semantic_errors(cfg: dict, base_dir: Path) -> list[str]:
    errors = []
    tok = cfg["tokenizer"]
    if tok["main_vocab_size"] not in tok["vocab_sizes"]:
        errors.append(
            f"config key 'tokenizer.main_vocab_size': {tok['main_vocab_size']} is not one of "
            f"tokenizer.vocab_sizes {tok['vocab_sizes']}"
        )
    pre = cfg["pretrain"]
    if pre["batch_sequences"] % pre["micro_batch_sequences"]:
        errors.append(
            f"config key 'pretrain.batch_sequences': {pre['batch_sequences']} is not a multiple of "
            f"pretrain.micro_batch_sequences ({pre['micro_batch_sequences']})"
        )
    longest = max(cfg["packing"]["block_tokens"], cfg["glue"]["max_length_tokens"])
    for name, model in cfg["models"].items():
        arch = model["arch"]
        if arch["hidden_size"] % arch["heads"]:
            errors.append(
                f"config key 'models.{name}.arch.heads': {arch['heads']} does not divide hidden_size {arch['hidden_size']}"
            )
        if arch["ffn"] == "glu" and arch["intermediate_size"] % 2:
            errors.append(f"config key 'models.{name}.arch.intermediate_size': must be even for ffn: glu")
        if arch["max_positions"] < longest:
            errors.append(
                f"config key 'models.{name}.arch.max_positions': {arch['max_positions']} is shorter than the "
                f"longest input ({longest} tokens from packing.block_tokens / glue.max_length_tokens)"
            )
    if not any(m["pretrain"] for m in cfg["models"].values()):
        errors.append("config key 'models': at least one model needs pretrain: true")
    if cfg["source"] == "hub" and cfg["hub"]["mirror"] is not None:
        mirror = Path(cfg["hub"]["mirror"])
        mirror = mirror if mirror.is_absolute() else base_dir / mirror
        if not mirror.is_dir():
            errors.append(f"config key 'hub.mirror': folder {str(mirror)!r} does not exist")
    return errors


def validate_config(cfg: dict, schema_path: str | Path = DEFAULT_SCHEMA, base_dir: str | Path = ".") -> dict:
    """Validate ``cfg`` in place (filling defaults) and return it; raise ConfigError listing every problem."""
    schema = load_yaml(schema_path)
    errors = sorted(_Validator(schema).iter_errors(cfg), key=lambda e: list(map(str, e.absolute_path)))
    messages = [_describe(e) for e in errors]
    if not messages:
        messages = _semantic_errors(cfg, Path(base_dir))
    if messages:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(messages))
    return cfg


def load_config(paths: Iterable[str | Path], schema_path: str | Path = DEFAULT_SCHEMA, base_dir: str | Path = ".") -> dict:
    cfg: dict = {}
    for path in paths:
        cfg = deep_merge(cfg, load_yaml(path))
    return validate_config(cfg, schema_path, base_dir)
