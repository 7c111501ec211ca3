import copy
import subprocess
import sys

import pytest

from cramswarm.config import ConfigError, load_config, load_yaml, resolve_runs, validate_config


@pytest.fixture
def default(repo):
    return load_yaml(repo / "config" / "config.yaml")


def check(cfg, repo):
    return validate_config(copy.deepcopy(cfg), repo / "config" / "schema.yaml", base_dir=repo)


@pytest.mark.parametrize(
    "overlays",
    [
        [],
        ["paper.yaml"],
        ["paper.yaml", "recipes/cramming-v1.yaml", "recipes/cramming-8gpu-48h.yaml"],
        ["paper.yaml", "paper_mirror.yaml"],
        ["test/tiny.yaml"],
        ["mirror.yaml"],
        ["mirror.yaml", "mirror_arch.yaml"],
        ["mirror.yaml", "realtext.yaml"],
        ["swarm_testbed.yaml"],
    ],
)
def test_shipped_configs_validate(repo, overlays, monkeypatch):
    if any(o.endswith("mirror.yaml") for o in overlays) and not (repo.parent / "shared" / "data" / "hub").is_dir():
        pytest.skip("config/mirror.yaml points at ../shared/data/hub, which is absent here")
    monkeypatch.chdir(repo)
    cfg = load_config([repo / "config" / "config.yaml", *(repo / "config" / o for o in overlays)], base_dir=repo)
    assert cfg["tokenizer"]["main_vocab_size"] in cfg["tokenizer"]["vocab_sizes"]


def test_defaults_are_filled(repo, default):
    cfg = check(default, repo)
    assert cfg["models"]["crammed"]["arch"]["norm_scheme"] == "pre"
    assert cfg["packing"]["block_tokens"] == 128


def test_impl_defaults_are_the_schemas_and_the_impl_keys_are_the_sections(repo):
    """cramswarm.impl's dataclass and key lists cannot drift from config/schema.yaml."""
    import dataclasses

    from cramswarm.impl import PRETRAIN_IMPL_KEYS, SWARM_IMPL_KEYS, PretrainImpl

    schema = load_yaml(repo / "config" / "schema.yaml")["properties"]
    pretrain = schema["pretrain"]["properties"]["impl"]["properties"]
    defaults = {f.name: f.default for f in dataclasses.fields(PretrainImpl)}
    assert defaults == {k: v["default"] for k, v in pretrain.items()}
    assert set(PRETRAIN_IMPL_KEYS) == set(pretrain)
    assert set(SWARM_IMPL_KEYS) == set(schema["swarm"]["properties"]["impl"]["properties"])
    assert not set(PRETRAIN_IMPL_KEYS) & set(schema["pretrain"]["properties"])  # a key lives in one place only
    assert not set(SWARM_IMPL_KEYS) & set(schema["swarm"]["properties"])


def mutate(cfg, path, value):
    node = cfg
    *parents, last = path
    for key in parents:
        node = node[key]
    node[last] = value
    return cfg


@pytest.mark.parametrize(
    "path, value, expected",
    [
        (("glue", "bogus"), 1, ["unknown config key 'glue.bogus'", "allowed keys here"]),
        (("tokenizer", "vocab_sizes"), [0], ["tokenizer.vocab_sizes[0]", "minimum"]),
        (("tokenizer", "vocab_sizes"), [512.5], ["tokenizer.vocab_sizes[0]", "integer"]),
        (("tokenizer", "vocab_sizes"), "512", ["tokenizer.vocab_sizes", "array"]),
        (("glue", "tasks"), ["cola", "squad"], ["glue.tasks[1]", "'squad'", "allowed values: cola, sst2"]),
        (("source",), "web", ["'source'", "allowed values: synthetic, hub"]),
        (("glue", "protocols", "crammed", "epochs"), 11, ["glue.protocols.crammed.epochs", "maximum"]),
        (
            ("glue", "protocols", "crammed", "schedule"),
            "polynomial",
            ["glue.protocols.crammed.schedule", "cosine, linear, constant"],
        ),
        (("glue", "protocol"), "mine", ["config key 'glue.protocol': 'mine' is not in glue.protocols"]),
        (("models", "izsak", "glue_protocol"), "nope", ["config key 'models.izsak.glue_protocol': 'nope' is not in"]),
        (("pretrain", "budget"), {"unit": "hours", "value": 24}, ["pretrain.budget.unit", "tokens, steps, seconds"]),
        (("pretrain", "budget"), {"unit": "tokens", "value": 0}, ["pretrain.budget.value"]),
        (("tokenizer", "main_vocab_size"), 4096, ["tokenizer.main_vocab_size", "not one of"]),
        (("pretrain", "batch_sequences"), 48, ["pretrain.batch_sequences", "multiple"]),
        (("pretrain", "impl", "compile_mode"), "fast", ["pretrain.impl.compile_mode", "max-autotune"]),
        (("pretrain", "impl", "devices"), 0, ["pretrain.impl.devices"]),
        (("pretrain", "impl", "attention_backend"), "cudnn", ["pretrain.impl.attention_backend", "math, flash"]),
        (("pretrain", "impl", "devices"), 3, ["pretrain.micro_batch_sequences", "devices x nodes = 3"]),
        (("pretrain", "impl", "nodes"), 3, ["pretrain.micro_batch_sequences", "devices x nodes = 3"]),
        (("pretrain", "impl", "bogus"), 1, ["unknown config key 'pretrain.impl.bogus'"]),
        (("swarm", "impl", "placement"), "mpirun", ["swarm.impl.placement", "local, attach, srun"]),
        # keys of an older config name their new place
        (("pretrain", "prefetch"), False, ["'pretrain.prefetch' has moved to 'pretrain.impl.prefetch'"]),
        (("pretrain", "log_every_steps"), 5, ["'pretrain.log_every_steps' has moved to 'pretrain.impl.log_every"]),
        (("swarm", "checkpoint_every_s"), 5.0, ["'swarm.checkpoint_every_s' has moved to 'swarm.impl.checkpoint"]),
        (("models", "izsak", "recipe", "devices"), 2, ["'models.izsak.recipe.devices' has moved to 'pretrain.impl"]),
        (("models", "izsak", "recipe", "impl"), {"devices": 2}, ["'models.izsak.recipe.impl'", "set once"]),
        (("models", "crammed", "arch", "heads"), 3, ["models.crammed.arch.heads", "divide"]),
        (("models", "crammed", "arch", "ffn"), "swiglu", ["models.crammed.arch.ffn", "glu, gelu"]),
        (("models", "crammed", "arch", "sparse_prediction"), "dense", ["models.crammed.arch.sparse_prediction"]),
        (("models", "crammed", "arch", "sparse_prediction_rate"), 0, ["models.crammed.arch.sparse_prediction_rate"]),
        (("pretrain", "schedule"), "cyclic", ["pretrain.schedule", "allowed values: triangle"]),
        (("pretrain", "mask_mode"), "span", ["pretrain.mask_mode", "fixed, bernoulli"]),
        (("pretrain", "budget"), {"unit": "steps", "value": -5}, ["pretrain.budget.value"]),
        (("pretrain", "batch_ramp_fraction"), 1.0, ["pretrain.batch_ramp_fraction"]),
        (
            ("models", "bert_original", "recipe", "mask_mode"),
            "random",
            ["models.bert_original.recipe.mask_mode", "fixed, bernoulli"],
        ),
        (("models", "bert_original", "recipe", "bogus"), 1, ["unknown config key 'models.bert_original.recipe.bogus'"]),
        (
            ("models", "bert_original", "recipe", "batch_sequences"),
            48,
            ["models.bert_original.recipe.batch_sequences", "multiple"],
        ),
        (("models", "izsak", "recipe", "budget"), {"unit": "tokens", "value": 0}, ["models.izsak.recipe.budget.value"]),
        (("ablations", "groups", "original_model"), "bert", ["ablations.groups.original_model", "not in models"]),
        (("ablations", "arch", "models"), ["no_pretrain"], ["ablations.arch.models[0]", "pretrain: false"]),
        (
            ("ablations", "arch", "variants"),
            [{"name": "x", "arch": {"heads": 3}}],
            ["ablations.arch.variants[0].arch.heads", "divide"],
        ),
        (
            ("ablations", "arch", "variants"),
            [{"name": "x", "arch": {"ffn": "relu"}}],
            ["ablations.arch.variants[0].arch.ffn", "glu, gelu"],
        ),
        (
            ("ablations", "arch", "variants"),
            [{"name": "x", "arch": {"layers": 1}}, {"name": "x", "arch": {}}],
            ["ablations.arch.variants[1].name", "used twice"],
        ),
        (("ablations", "schedule", "schedules"), ["warmup-stable-decay"], ["ablations.schedule.schedules[0]"]),
        (
            ("swarm", "stages"),
            3,
            ["config key 'swarm.stages': 3 stages do not divide the 2 layers of models.swarm.arch"],
        ),
        (("swarm", "compression"), "int4", ["swarm.compression", "none, fp16, blockwise8"]),
        (("swarm", "averaging_compression"), "blockwise8", ["swarm.averaging_compression", "none, fp16, 8bit"]),
        (("swarm", "link_mbit_s"), 0, ["swarm.link_mbit_s"]),
        (("swarm", "peers_per_stage"), 0, ["swarm.peers_per_stage", "minimum"]),
        (("swarm", "transport"), "grpc", ["swarm.transport", "emulation, hivemind"]),
        (("swarm", "impl", "placement"), "srun", ["config key 'swarm.impl.placement'", "needs swarm.transport"]),
        (("swarm", "impl", "host"), "node01", ["swarm.impl.host", "does not match"]),
        (("swarm", "impl", "interface"), "", ["swarm.impl.interface"]),
        (("models", "no_pretrain", "trainer"), "swarm", ["models.no_pretrain.trainer", "needs pretrain: true"]),
        (("swarm_study", "compression", "stages"), 4, ["swarm_study.compression.stages", "do not divide"]),
        (("swarm_study", "wiring", "speeds"), [1.5], ["swarm_study.wiring.speeds[0]", "maximum"]),
        (("swarm_study", "rebalancing", "starved_stage"), 3,
         ["swarm_study.rebalancing.starved_stage", "does not exist"]),
        (("swarm_study", "wiring", "sweep_speeds"), ["fast"], ["swarm_study.wiring.sweep_speeds[0]", "mixed, equal"]),
        (
            ("swarm_study", "sim_scale", "preemption_models"),
            ["meteor"],
            ["swarm_study.sim_scale.preemption_models[0]", "independent, burst, churn_random, churn_most_loaded"],
        ),
        (("swarm_study", "sim_scale", "nic_mbit_s"), 0, ["swarm_study.sim_scale.nic_mbit_s"]),
    ],
)
def test_invalid_values_name_the_key(repo, default, path, value, expected):
    with pytest.raises(ConfigError) as err:
        check(mutate(default, path, value), repo)
    for text in expected:
        assert text in str(err.value)


def test_a_study_needs_one_model_in_it(repo, default):
    for model in default["models"].values():
        model["study"] = False
    with pytest.raises(ConfigError, match="'models': at least one model needs study: true"):
        check(default, repo)


def test_narrowing_compression_needs_a_boundary_on_either_transport(repo, default):
    for transport in ("emulation", "hivemind"):
        cfg = mutate(mutate(default, ("swarm", "compression"), "bottleneck4"), ("swarm", "transport"), transport)
        with pytest.raises(ConfigError, match=r"'swarm.compression': bottleneck4 needs swarm.stages >= 2"):
            check(mutate(cfg, ("swarm", "stages"), 1), repo)
        check(mutate(cfg, ("swarm", "stages"), 2), repo)   # both transports train it


def test_missing_mirror_folder_is_rejected(repo, default):
    cfg = mutate(mutate(default, ("source",), "hub"), ("hub", "mirror"), "no/such/folder")
    with pytest.raises(ConfigError, match=r"hub.mirror.*does not exist"):
        check(cfg, repo)


def test_overlay_replaces_budget_unit(repo, tmp_path):
    overlay = tmp_path / "o.yaml"
    overlay.write_text("pretrain:\n  budget: {unit: steps, value: 10}\n")
    cfg = load_config([repo / "config" / "config.yaml", overlay])
    assert cfg["pretrain"]["budget"] == {
        "unit": "steps",
        "value": 10,
        "reference_card": None,
        "device_peak_tflops": None,
    }


def test_reference_card_needs_a_seconds_budget(repo, tmp_path):
    overlay = tmp_path / "o.yaml"
    overlay.write_text("pretrain:\n  budget: {unit: tokens, value: 10, reference_card: a6000}\n")
    with pytest.raises(ConfigError, match=r"models\.crammed\.recipe\.budget\.reference_card.*seconds"):
        load_config([repo / "config" / "config.yaml", overlay])


def test_swarm_models_reject_recipe_keys_their_trainers_lack(repo, tmp_path):
    overlay = tmp_path / "o.yaml"
    overlay.write_text("models:\n  swarm:\n    recipe: {dropout: 0.1, optimizer: adam_l2}\n")
    with pytest.raises(ConfigError) as err:
        load_config([repo / "config" / "config.yaml", overlay])
    assert "models.swarm.recipe.dropout" in str(err.value) and "recompute" in str(err.value)
    # what their steps do take from pretrain: the optimizer, a ramp in micro-steps, a schedule horizon
    overlay.write_text("models:\n  swarm:\n    recipe: {optimizer: adam_l2, batch_ramp_micro_steps: 8, "
                       "schedule_horizon_sequences: {warmup: 16, total: 640}}\n")
    recipe = load_config([repo / "config" / "config.yaml", overlay])["models"]["swarm"]["recipe"]
    assert recipe["optimizer"] == "adam_l2" and recipe["batch_ramp_micro_steps"] == 8


def test_schedule_sweep_gives_inverse_sqrt_the_reference_warmup(repo):
    runs = resolve_runs(load_config([repo / "config" / "config.yaml"]))
    sweep = {name: run["recipe"] for name, run in runs.items() if name.startswith("sched-")}
    assert sweep and all(r["warmup_fraction"] == 0.05 for n, r in sweep.items() if "inverse-sqrt" in n)
    assert all(r["warmup_fraction"] == 0.06 for n, r in sweep.items() if "cosine" in n)


def test_cli_check_config_exit_code(repo, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tokenizer:\n  vocab_sizes: [0]\n")
    proc = subprocess.run(
        [sys.executable, "-m", "cramswarm", "check-config", str(repo / "config" / "config.yaml"), str(bad)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "tokenizer.vocab_sizes[0]" in proc.stderr


def test_snakemake_rejects_bad_config_before_any_job(repo, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("glue:\n  tasks: [cola, squad]\n")
    proc = subprocess.run(
        ["snakemake", "-n", "--configfile", "config/config.yaml", str(bad)], cwd=repo, capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "glue.tasks[1]" in proc.stdout + proc.stderr
    assert "Job stats" not in proc.stdout


def test_runs_carry_full_arch_and_merged_recipe(repo, default):
    from cramswarm.config import resolve_runs

    cfg = check(default, repo)
    runs = resolve_runs(cfg)
    bert = runs["bert_original"]
    assert bert["arch"]["norm_scheme"] == "post" and bert["arch"]["sparse_prediction"] is False
    assert bert["recipe"]["mask_rate"] == 0.15 and bert["recipe"]["budget"] == cfg["pretrain"]["budget"]
    assert bert["recipe"]["micro_batch_sequences"] == cfg["pretrain"]["micro_batch_sequences"]  # not overridden
    for name, run in runs.items():
        if run["study"] != "models":
            assert run["recipe"]["budget"] == cfg["ablations"]["budget"], name
    sched = [r for r in runs.values() if r["study"] == "schedule"]
    n = len(cfg["ablations"]["schedule"]["schedules"]) * len(cfg["ablations"]["schedule"]["lrs"])
    assert len(sched) == n and {r["recipe"]["schedule"] for r in sched} == set(
        cfg["ablations"]["schedule"]["schedules"]
    )
    groups = {name: r for name, r in runs.items() if r["study"] == "groups"}
    assert groups["groups-original_arch"]["arch"] == bert["arch"]
    assert groups["groups-original_arch"]["recipe"]["mask_rate"] == 0.25  # crammed training
    assert groups["groups-original_training"]["recipe"]["lr"] == bert["recipe"]["lr"]
    assert runs["arch-depth4"]["arch"] == {**cfg["models"]["crammed"]["arch"], "layers": 4}


def test_model_info_prints_the_paper_shape_parameter_count(repo):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cramswarm",
            "model-info",
            "config/config.yaml",
            "config/paper.yaml",
            "--runs",
            "crammed",
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "crammed: 16 layers x 768 (12 heads), vocab 32768: 119,589,889 parameters" in out


def test_lr_from_sweep_links_the_model_to_its_schedules_runs(repo, tmp_path):
    overlay = tmp_path / "o.yaml"
    overlay.write_text("models:\n  crammed:\n    lr_from_sweep: true\n"
                       "ablations:\n  schedule:\n    schedules: [triangle, cosine]\n    lrs: [5.0e-4, 2.0e-3]\n")
    runs = resolve_runs(load_config([repo / "config" / "config.yaml", overlay]))
    assert runs["crammed"]["recipe"]["schedule"] == "triangle"
    assert runs["crammed"]["lr_from"] == {5e-4: "sched-triangle-lr0.0005", 2e-3: "sched-triangle-lr0.002"}
    sweep = runs["crammed"]["lr_from"].items()
    assert all(runs[r]["recipe"]["lr"] == lr and runs[r]["lr_from"] is None for lr, r in sweep)
    assert runs["bert_original"]["lr_from"] is None


@pytest.mark.parametrize(
    "overlay, expected",
    [
        ("ablations:\n  schedule:\n    schedules: [cosine]\n", "the model's schedule 'triangle' is not in"),
        ("ablations:\n  schedule:\n    base_model: bert_original\n", "set ablations.schedule.base_model: crammed"),
        ("models:\n  crammed:\n    trainer: swarm\n", "trainer: single"),
    ],
)
def test_lr_from_sweep_refusals_name_the_key(repo, tmp_path, overlay, expected):
    path = tmp_path / "o.yaml"
    path.write_text("models:\n  crammed:\n    lr_from_sweep: true\n")
    extra = tmp_path / "x.yaml"
    extra.write_text(overlay)
    with pytest.raises(ConfigError) as err:
        load_config([repo / "config" / "config.yaml", path, extra])
    assert "models.crammed.lr_from_sweep" in str(err.value) and expected in str(err.value)


def test_realtext_overlay_takes_the_lr_from_its_own_sweep(repo, tmp_path):
    """config/realtext.yaml (issue 20) validates on top of the mirror study and resolves to what claim C5 needs:
    crammed at its study budget with the LR of a triangle sweep on the same text, enough seeds for C5's test."""
    from cramswarm.report.claim_tests import MIN_PAIRS

    mirror = tmp_path / "hub"
    mirror.mkdir()  # the overlay's ../shared/data/hub may be absent (CI): an empty stand-in, nothing is read
    pin = tmp_path / "pin.yaml"
    pin.write_text(f"hub:\n  mirror: {mirror}\n")
    overlays = [repo / "config" / name for name in ("config.yaml", "mirror.yaml", "realtext.yaml")]
    cfg = load_config([*overlays, pin], base_dir=repo)
    runs = resolve_runs(cfg)
    assert cfg["source"] == "hub" and cfg["hub"]["glue_max_train_examples"] == 2000
    crammed = runs["crammed"]
    sweep = cfg["ablations"]["schedule"]
    assert sweep["schedules"] == [crammed["recipe"]["schedule"]] and len(sweep["lrs"]) >= 3
    assert crammed["lr_from"] == {lr: f"sched-triangle-lr{lr:g}" for lr in sweep["lrs"]}
    for lr, run in crammed["lr_from"].items():  # the sweep: same model and text, the ablation budget
        assert runs[run]["arch"] == crammed["arch"] and runs[run]["recipe"]["lr"] == lr
        assert runs[run]["recipe"]["budget"] == cfg["ablations"]["budget"]
    assert crammed["recipe"]["budget"]["value"] > cfg["ablations"]["budget"]["value"]
    assert runs["no_pretrain"]["arch"] == crammed["arch"]
    assert len(cfg["glue"]["seeds"]) >= MIN_PAIRS


def test_the_testbed_study_overlay_hands_every_setting_to_its_experiment(repo):
    """config/swarm_testbed.yaml reruns the committed testbed study through the workflow: each swarm_study section,
    as the swarm-study command passes it, binds to its study function, with the testbed among the transports."""
    import inspect

    from cramswarm.swarm_study import study
    from cramswarm.swarm_study.commands import EXPERIMENTS

    cfg = load_config([repo / "config" / "config.yaml", repo / "config" / "swarm_testbed.yaml"], base_dir=repo)
    for experiment, section in (("wiring_throughput", "wiring"), ("failures_timeline", "failures"),
                                ("rebalancing_recovery", "rebalancing")):
        settings = cfg["swarm_study"][section]
        assert "testbed" in settings["transports"]
        kwargs = {EXPERIMENTS[experiment].get(k, k): v for k, v in settings.items()}
        inspect.signature(getattr(study, experiment)).bind("out.csv", **kwargs)  # TypeError on an unknown key
