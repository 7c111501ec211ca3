"""Load, merge and validate workflow configs against config/schema.yaml.

Used by the Snakefile (through rules/common.smk) before any job runs, and by
``python -m cramswarm check-config``. Errors name the offending key as a dotted path
(``tokenizer.vocab_sizes[0]``) and, for enumerations and unknown keys, the allowed values.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any, Iterable

import yaml
from jsonschema import Draft202012Validator, validators

from cramswarm.impl import PRETRAIN_IMPL_KEYS, SWARM_IMPL_KEYS, computed


def _repo_root() -> Path:
    """The workflow's checkout: the source tree this package lies in (an editable install, as the README's), else
    the working directory (the package installed as a wheel, run from the checkout as Snakemake runs it)."""
    tree = Path(__file__).resolve().parents[2]
    return tree if (tree / "config" / "schema.yaml").is_file() else Path.cwd()


REPO_ROOT = _repo_root()
DEFAULT_SCHEMA = REPO_ROOT / "config" / "schema.yaml"


def _resolve_ref(node: dict, schema: dict) -> dict:
    ref = node.get("$ref", "")
    if ref.startswith("#/"):
        for part in ref[2:].split("/"):
            schema = schema[part]
        return schema
    return node


def schema_default(dotted: str, schema_path: str | Path = DEFAULT_SCHEMA) -> Any:
    """The schema's ``default`` of a dotted config key, e.g. ``data.memory_cap_mb``.

    The command-line options that mirror config keys take their defaults from here, so a command run by hand
    behaves like the workflow with an unset key.
    """
    schema = _load_schema(str(schema_path))
    node = schema
    for part in dotted.split("."):
        if "properties" not in node:
            node = _resolve_ref(node, schema)
        try:
            node = node["properties"][part]
        except KeyError:
            raise KeyError(f"{dotted}: no such key in {schema_path}") from None
    if "default" not in node:
        node = _resolve_ref(node, schema)
    if "default" not in node:
        raise KeyError(f"{dotted}: the schema gives no default")
    return copy.deepcopy(node["default"])


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
        allowed = ", ".join(map(str, error.validator_value))
        return f"config key '{where}': {error.instance!r} is not allowed; allowed values: {allowed}"
    return f"config key '{where}': {error.message}"


# libyaml's loader where PyYAML was built with it: the schema alone takes about 1 s with the pure-Python one,
# which every `snakemake -n` pays.
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=4)
def _load_schema(path: str) -> dict:
    with open(path) as fh:
        return yaml.load(fh, Loader=_SAFE_LOADER)


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_SAFE_LOADER)
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


def _subschema_errors(instance: dict, schema: dict, defs: dict, where: str) -> tuple[dict, list[str]]:
    """Validate (and fill defaults of) ``instance`` against ``schema``; error paths are prefixed with ``where``."""
    instance = copy.deepcopy(instance)
    errors = _Validator({**schema, "$defs": defs}).iter_errors(instance)
    messages = []
    for error in sorted(errors, key=lambda e: list(map(str, e.absolute_path))):
        error.path.extendleft(reversed(where.split(".")))
        messages.append(_describe(error))
    return instance, messages


def _batch_errors(recipe: dict, where: str, impl: dict) -> list[str]:
    if recipe["batch_sequences"] % recipe["micro_batch_sequences"]:
        return [
            f"config key '{where}.batch_sequences': {recipe['batch_sequences']} is not a multiple of "
            f"{where}.micro_batch_sequences ({recipe['micro_batch_sequences']})"
        ]
    processes = impl["devices"] * impl["nodes"]
    if recipe["micro_batch_sequences"] % processes:
        return [
            f"config key '{where}.micro_batch_sequences': {recipe['micro_batch_sequences']} sequences cannot be "
            f"split evenly over pretrain.impl devices x nodes = {processes} data-parallel processes"
        ]
    return []


def _moved_key_errors(cfg: dict) -> list[str]:
    """Keys of an older config that now live in an impl section (cramswarm.impl), each named with its new place."""
    sections = [("pretrain", cfg.get("pretrain"), PRETRAIN_IMPL_KEYS, "pretrain.impl"),
                ("swarm", cfg.get("swarm"), SWARM_IMPL_KEYS, "swarm.impl")]  # fmt: skip
    for name, model in (cfg.get("models") or {}).items():
        if isinstance(model, dict):
            sections.append((f"models.{name}.recipe", model.get("recipe"), PRETRAIN_IMPL_KEYS, "pretrain.impl"))
    errors = []
    for where, section, keys, home in sections:
        if not isinstance(section, dict):
            continue
        for key in [k for k in keys if k in section]:
            errors.append(f"config key '{where}.{key}' has moved to '{home}.{key}': it says how a run executes, "
                          "not what it computes (so changing it reruns nothing)")
        if where.startswith("models.") and "impl" in section:
            errors.append(f"config key '{where}.impl': how runs execute is set once for every model, in "
                          "pretrain.impl")
    return errors


def _arch_errors(arch: dict, where: str, longest: int) -> list[str]:
    errors = []
    if arch["hidden_size"] % arch["heads"]:
        errors.append(f"config key '{where}.heads': {arch['heads']} does not divide hidden_size {arch['hidden_size']}")
    if arch["ffn"] == "glu" and arch["intermediate_size"] % 2:
        errors.append(f"config key '{where}.intermediate_size': must be even for ffn: glu")
    if arch["max_positions"] < longest:
        errors.append(
            f"config key '{where}.max_positions': {arch['max_positions']} is shorter than the "
            f"longest input ({longest} tokens from packing.block_tokens / glue.max_length_tokens)"
        )
    return errors


def _model_ref_errors(cfg: dict, where: str, name: str) -> list[str]:
    """An ablation's reference to a study model: it must exist and be pretrained."""
    if name not in cfg["models"]:
        return [f"config key '{where}': model {name!r} is not in models ({', '.join(cfg['models'])})"]
    if not cfg["models"][name]["pretrain"]:
        return [f"config key '{where}': model {name!r} has pretrain: false; an ablation needs a pretrained model"]
    return []


def _budget_errors(budget: dict, where: str) -> list[str]:
    if budget.get("reference_card") and budget["unit"] != "seconds":
        return [f"config key '{where}.reference_card': applies to a seconds budget, not to unit {budget['unit']!r}"]
    return []


def _swarm_recipe_errors(recipe: dict, where: str) -> list[str]:
    """Recipe settings the SWARM trainers do not implement. Their steps take pretrain's optimizer, batch ramp and
    LR schedule (``training.make_optimizer``, ``step_accumulation``, ``step_lr``); dropout is refused because a
    stage recomputes its forward pass in the backward call (as SWARM's code does) and would draw other masks."""
    errors = []
    if recipe["budget"]["unit"] == "exaflop" or recipe["budget"].get("reference_card"):
        errors.append(f"config key '{where}.budget': SWARM runs take tokens, steps, model_tflop or seconds, not a "
                      "normalised budget")
    if recipe.get("dropout", 0.0) != 0.0:
        errors.append(f"config key '{where}.dropout': SWARM trainers support only 0.0 (a stage recomputes its "
                      "forward pass in the backward call, where dropout would draw other masks)")
    return errors


def swarm_study_model(cfg: dict) -> str:
    """The model whose arch swarm_study's compression experiment uses: the first with trainer: swarm, else crammed."""
    return next((name for name, model in cfg["models"].items() if model["trainer"] == "swarm"), "crammed")


def _lr_sweep_errors(cfg: dict) -> list[str]:
    """A model with ``lr_from_sweep`` takes its peak LR from ablations.schedule's runs: those must be runs of this
    model (base_model) and of its schedule (the schema keeps ablations.schedule.lrs non-empty)."""
    errors = []
    sweep = cfg["ablations"]["schedule"]
    for name, model in cfg["models"].items():
        if not model.get("lr_from_sweep"):
            continue
        key = f"config key 'models.{name}.lr_from_sweep'"
        if not model["pretrain"] or model["trainer"] != "single":
            errors.append(f"{key}: only a model pretrained by one process (pretrain: true, trainer: single) takes "
                          "its LR from the sweep")
        if sweep["base_model"] != name:
            errors.append(f"{key}: ablations.schedule.base_model is {sweep['base_model']!r}, so the sweep's runs are "
                          f"not of {name!r} (set ablations.schedule.base_model: {name})")
        schedule = model_recipe(cfg, name).get("schedule")
        if schedule not in sweep["schedules"]:
            errors.append(f"{key}: the model's schedule {schedule!r} is not in ablations.schedule.schedules "
                          f"{sweep['schedules']}")
    return errors


def lr_sweep_runs(cfg: dict, name: str) -> dict[float, str] | None:
    """{peak LR: ablation run name} of the schedule sweep that model ``name`` takes its LR from (None: its own)."""
    if not cfg["models"][name].get("lr_from_sweep"):
        return None
    schedule = model_recipe(cfg, name)["schedule"]
    return {lr: f"sched-{schedule}-lr{_fmt_lr(lr)}" for lr in cfg["ablations"]["schedule"]["lrs"]}


def _semantic_errors(cfg: dict, base_dir: Path, schema: dict) -> list[str]:
    errors = []
    tok = cfg["tokenizer"]
    if tok["main_vocab_size"] not in tok["vocab_sizes"]:
        errors.append(
            f"config key 'tokenizer.main_vocab_size': {tok['main_vocab_size']} is not one of "
            f"tokenizer.vocab_sizes {tok['vocab_sizes']}"
        )
    impl = cfg["pretrain"]["impl"]
    errors += _batch_errors(cfg["pretrain"], "pretrain", impl)
    pretrain_schema, defs = schema["properties"]["pretrain"], schema["$defs"]
    longest = max(cfg["packing"]["block_tokens"], cfg["glue"]["max_length_tokens"])
    for name, model in cfg["models"].items():
        errors += _arch_errors(model["arch"], f"models.{name}.arch", longest)
        where = f"models.{name}.recipe"
        recipe, messages = _subschema_errors(deep_merge(cfg["pretrain"], model["recipe"]), pretrain_schema, defs, where)
        errors += messages or _batch_errors(recipe, where, impl)
        if not messages:
            errors += _budget_errors(recipe["budget"], f"{where}.budget")
            if model.get("trainer", "single") == "swarm":
                errors += _swarm_recipe_errors(recipe, where)
    protocols = cfg["glue"]["protocols"]
    for where, name in [("glue.protocol", cfg["glue"]["protocol"])] + [
        (f"models.{m}.glue_protocol", spec["glue_protocol"]) for m, spec in cfg["models"].items()
    ]:
        if name is not None and name not in protocols:
            errors.append(f"config key '{where}': {name!r} is not in glue.protocols ({', '.join(protocols)})")
    if not any(m["pretrain"] for m in cfg["models"].values()):
        errors.append("config key 'models': at least one model needs pretrain: true")
    if not any(m["study"] for m in cfg["models"].values()):
        errors.append("config key 'models': at least one model needs study: true (the study's table is of them)")
    rebalancing = cfg["swarm_study"]["rebalancing"]
    if rebalancing["starved_stage"] >= rebalancing["stages"]:
        errors.append(f"config key 'swarm_study.rebalancing.starved_stage': stage {rebalancing['starved_stage']} "
                      f"does not exist (swarm_study.rebalancing.stages is {rebalancing['stages']}, counted from 0)")
    split = swarm_study_model(cfg)  # the model swarm_study's compression experiment splits into stages
    stages = cfg["swarm_study"]["compression"]["stages"]
    if split in cfg["models"] and cfg["models"][split]["arch"]["layers"] % stages:
        errors.append(
            f"config key 'swarm_study.compression.stages': {stages} stages do not divide the "
            f"{cfg['models'][split]['arch']['layers']} layers of models.{split} (the model the experiment splits)"
        )
    if cfg["swarm"]["impl"]["placement"] != "local" and cfg["swarm"]["transport"] != "hivemind":
        errors.append(
            f"config key 'swarm.impl.placement': {cfg['swarm']['impl']['placement']} starts the peers as separate "
            f"processes, which needs swarm.transport: hivemind (not {cfg['swarm']['transport']})"
        )
    stages = cfg["swarm"]["stages"]
    compression = cfg["swarm"]["compression"]
    if compression.startswith(("bottleneck", "maxout")):
        if stages < 2:
            errors.append(f"config key 'swarm.compression': {compression} needs swarm.stages >= 2 (a boundary)")
    errors += _lr_sweep_errors(cfg)
    for name, model in cfg["models"].items():
        if model["trainer"] != "swarm":
            continue
        factor = int(compression[-1]) if compression.startswith(("bottleneck", "maxout")) else 1
        if model["arch"]["hidden_size"] % factor:
            errors.append(
                f"config key 'swarm.compression': {compression}'s factor {factor} does not divide "
                f"models.{name}.arch.hidden_size ({model['arch']['hidden_size']})"
            )
        if not model["pretrain"]:
            errors.append(
                f"config key 'models.{name}.trainer': swarm needs pretrain: true (a random-init model is not trained)"
            )
        elif model["arch"]["layers"] % stages:
            errors.append(
                f"config key 'swarm.stages': {stages} stages do not divide the {model['arch']['layers']} layers of "
                f"models.{name}.arch (each stage holds layers / stages layers)"
            )
    abl = cfg["ablations"]
    errors += _model_ref_errors(cfg, "ablations.arch.base_model", abl["arch"]["base_model"])
    for i, name in enumerate(abl["arch"]["models"]):
        errors += _model_ref_errors(cfg, f"ablations.arch.models[{i}]", name)
    errors += _model_ref_errors(cfg, "ablations.schedule.base_model", abl["schedule"]["base_model"])
    for key in ("final_model", "original_model"):
        errors += _model_ref_errors(cfg, f"ablations.groups.{key}", abl["groups"][key])
    if not errors:
        base_arch = cfg["models"][abl["arch"]["base_model"]]["arch"]
        names = [v["name"] for v in abl["arch"]["variants"]]
        for i, variant in enumerate(abl["arch"]["variants"]):
            where = f"ablations.arch.variants[{i}].arch"
            if names.count(variant["name"]) > 1:
                errors.append(f"config key 'ablations.arch.variants[{i}].name': {variant['name']!r} is used twice")
            arch, messages = _subschema_errors(deep_merge(base_arch, variant["arch"]), defs["arch"], defs, where)
            errors += messages or _arch_errors(arch, where, longest)
    errors += _data_errors(cfg)
    if cfg["source"] == "hub" and cfg["hub"]["mirror"] is not None:
        mirror = Path(cfg["hub"]["mirror"])
        mirror = mirror if mirror.is_absolute() else base_dir / mirror
        if not mirror.is_dir():
            errors.append(f"config key 'hub.mirror': folder {str(mirror)!r} does not exist")
    return errors


STUDY_CORPORA = ("synthetic", "hub")  # corpus names built from the config's own source sections
RECIPE_KEYS = ("trash_filter", "trash_cutoff", "dedup", "dedup_threshold", "order")


def _data_errors(cfg: dict) -> list[str]:
    errors = []
    for name in cfg["data"]["corpora"]:
        if name in STUDY_CORPORA:
            errors.append(f"config key 'data.corpora.{name}': the name is taken by the config's own {name!r} section")
    abl = cfg["ablations"]["data"]
    known = [*STUDY_CORPORA, *cfg["data"]["corpora"]]
    for i, name in enumerate(abl["sources"]):
        if name not in known:
            errors.append(f"config key 'ablations.data.sources[{i}]': {name!r} is not a corpus ({', '.join(known)})")
    names = [cell["name"] for cell in abl["cells"]]
    for i, name in enumerate(names):
        if names.count(name) > 1:
            errors.append(f"config key 'ablations.data.cells[{i}].name': {name!r} is used twice")
    return errors + _model_ref_errors(cfg, "ablations.data.base_model", abl["base_model"])


def data_recipe(cfg: dict, corpus: str | None = None, overrides: dict | None = None) -> dict:
    """The data recipe a run's blocks come from: corpus name, filters, order and tokenizer family."""
    recipe = {key: cfg["data"][key] for key in RECIPE_KEYS} | {"family": cfg["tokenizer"]["family"]}
    recipe |= {k: v for k, v in (overrides or {}).items() if k != "name"}
    return {"corpus": corpus or cfg["source"], **recipe}


def filters_key(recipe: dict) -> str:
    """The path segment naming a corpus variant: ``raw``, ``trash0.25``, ``dedup0.8`` or ``trash0.25-dedup0.8``
    (trash first, the paper's order). Settings of a switched-off filter are not part of it."""
    parts = [f"trash{recipe['trash_cutoff']:g}"] if recipe["trash_filter"] else []
    parts += [f"dedup{recipe['dedup_threshold']:g}"] if recipe["dedup"] else []
    return "-".join(parts) or "raw"


def data_wildcards(recipe: dict) -> dict:
    """The path wildcards of a recipe's files (cramswarm.workflow.study: FILTERED, TOKENIZER, PACKED, BLOCKS)."""
    return {
        "corpus": recipe["corpus"],
        "filters": filters_key(recipe),
        "family": recipe["family"],
        "order": recipe["order"],
    }


def corpus_spec(cfg: dict, name: str) -> dict:
    """What the ``corpus`` command reads for corpus ``name``: the keys of the source section it uses only."""
    if name == "synthetic":
        return {"source": "synthetic", "synthetic": {k: cfg["synthetic"][k] for k in ("seed", "corpus_documents")}}
    if name == "hub":
        return {"source": "hub", "hub": {k: cfg["hub"][k] for k in ("mirror", "corpus")}}
    spec = cfg["data"]["corpora"][name]
    if "synthetic" in spec:
        return {"source": "synthetic", "synthetic": spec["synthetic"]}
    return {"source": "hub", "hub": {"mirror": cfg["hub"]["mirror"], "corpus": spec["hub"]}}


def model_recipe(cfg: dict, name: str) -> dict:
    """What model ``name``'s pretraining computes: ``pretrain`` (less its ``impl``) with the model's ``recipe``
    overrides."""
    return deep_merge(computed(cfg["pretrain"]), cfg["models"][name]["recipe"])


def glue_protocol(cfg: dict, name: str | None = None) -> dict:
    """The fine-tuning protocol ``name`` (default: ``glue.protocol``) as the finetune command takes it:
    the protocols entry plus its ``name`` and the settings shared by every protocol."""
    glue = cfg["glue"]
    name = name or glue["protocol"]
    return {
        "name": name,
        **glue["protocols"][name],
        "max_length_tokens": glue["max_length_tokens"],
        "device": glue["device"],
    }


def _fmt_lr(lr: float) -> str:
    return f"{lr:g}"


def resolve_runs(cfg: dict) -> dict[str, dict]:
    """Every checkpoint the workflow can build, by run name, with its full arch and recipe.

    The study's models keep their names; ablation runs are ``arch-<variant>``, ``arch-<model>``,
    ``sched-<schedule>-lr<peak>``, ``groups-<row>`` and ``data-<source>-<cell>``, all trained at
    ``ablations.budget``. Each entry: ``{"pretrain", "vocab_sweep", "arch", "recipe", "glue", "study", "label",
    "data", "trainer", "lr_from"}`` (lr_from: ``{peak LR: schedule-sweep run}`` for a model with ``lr_from_sweep``,
    else None; trainer: single | swarm, ablation runs always single; study: models | arch | schedule |
    groups | data; glue: the fine-tuning protocol, :func:`glue_protocol`; data: the data recipe,
    :func:`data_recipe`). Ablation runs are fine-tuned with the
    study's default protocol (``glue.protocol``): they compare pretraining, so fine-tuning is held fixed.
    """
    runs = {
        name: {
            "pretrain": spec["pretrain"],
            "vocab_sweep": spec["vocab_sweep"],
            "arch": spec["arch"],
            "recipe": model_recipe(cfg, name),
            "glue": glue_protocol(cfg, spec["glue_protocol"]),
            "study": "models",
            "label": name,
            "data": data_recipe(cfg),
            "trainer": spec["trainer"],
            "lr_from": lr_sweep_runs(cfg, name),
        }
        for name, spec in cfg["models"].items()
    }
    abl = cfg["ablations"]

    def add(run: str, study: str, label: str, arch: dict, recipe: dict, data: dict | None = None) -> None:
        recipe = {**recipe, "budget": abl["budget"]}
        runs[run] = {
            "pretrain": True,
            "vocab_sweep": False,
            "arch": arch,
            "recipe": recipe,
            "glue": glue_protocol(cfg),
            "study": study,
            "label": label,
            "data": data or data_recipe(cfg),
            "trainer": "single",
            "lr_from": None,
        }

    base = abl["arch"]["base_model"]
    add(f"arch-{base}", "arch", base, cfg["models"][base]["arch"], model_recipe(cfg, base))
    for variant in abl["arch"]["variants"]:
        arch = deep_merge(cfg["models"][base]["arch"], variant["arch"])  # the base arch has its defaults filled
        add(f"arch-{variant['name']}", "arch", variant["name"], arch, model_recipe(cfg, base))
    for name in abl["arch"]["models"]:
        add(f"arch-{name}", "arch", name, cfg["models"][name]["arch"], model_recipe(cfg, name))
    sched = abl["schedule"]
    for schedule in sched["schedules"]:
        for lr in sched["lrs"]:
            recipe = {**model_recipe(cfg, sched["base_model"]), "schedule": schedule, "lr": lr}
            if schedule in sched["warmup_fractions"]:
                recipe["warmup_fraction"] = sched["warmup_fractions"][schedule]
            add(
                f"sched-{schedule}-lr{_fmt_lr(lr)}",
                "schedule",
                f"{schedule} @ {_fmt_lr(lr)}",
                cfg["models"][sched["base_model"]]["arch"],
                recipe,
            )
    final, original = abl["groups"]["final_model"], abl["groups"]["original_model"]
    rows = {
        "final": ("final (crammed arch + recipe)", final, final),
        "original_arch": ("original BERT architecture", original, final),
        "original_training": ("original BERT training recipe", final, original),
        "original_both": ("original BERT arch + training", original, original),
    }
    for row, (label, arch_from, recipe_from) in rows.items():
        add(f"groups-{row}", "groups", label, cfg["models"][arch_from]["arch"], model_recipe(cfg, recipe_from))
    base = abl["data"]["base_model"]
    for source in abl["data"]["sources"] or [cfg["source"]]:
        for cell in abl["data"]["cells"]:
            add(
                f"data-{source}-{cell['name']}",
                "data",
                f"{source} / {cell['name']}",
                cfg["models"][base]["arch"],
                model_recipe(cfg, base),
                data_recipe(cfg, source, cell),
            )
    return runs


def validate_config(cfg: dict, schema_path: str | Path = DEFAULT_SCHEMA, base_dir: str | Path = ".") -> dict:
    """Validate ``cfg`` in place (filling defaults) and return it; raise ConfigError listing every problem."""
    schema = load_yaml(schema_path)
    if moved := _moved_key_errors(cfg):
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(moved))
    errors = sorted(_Validator(schema).iter_errors(cfg), key=lambda e: list(map(str, e.absolute_path)))
    messages = [_describe(e) for e in errors]
    if not messages:
        messages = _semantic_errors(cfg, Path(base_dir), schema)
    if messages:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(messages))
    return cfg


def load_config(
    paths: Iterable[str | Path], schema_path: str | Path = DEFAULT_SCHEMA, base_dir: str | Path = "."
) -> dict:
    cfg: dict = {}
    for path in paths:
        cfg = deep_merge(cfg, load_yaml(path))
    return validate_config(cfg, schema_path, base_dir)
