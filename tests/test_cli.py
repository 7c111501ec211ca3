"""The command line: light to start, each command's defaults from the schema, model registration on demand."""

import subprocess
import sys

import pytest

from cramswarm.cli import COMMAND_MODULES, build_parser, load_commands
from cramswarm.config import schema_default


def _modules_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(sorted(m for m in sys.modules if '.' not in m)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_parser_and_the_package_import_neither_torch_nor_transformers():
    loaded = _modules_after("import cramswarm; from cramswarm.cli import build_parser; build_parser()")
    assert not loaded & {"torch", "transformers", "hivemind", "pandas", "matplotlib"}, loaded


def test_importing_the_models_registers_crammed_bert_with_the_auto_classes():
    probe = (
        "import cramswarm.models\nfrom transformers import AutoConfig\n"
        "print(type(AutoConfig.for_model('crammed-bert')).__name__)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "CrammedBertConfig"


def test_every_command_module_declares_commands_and_each_name_is_taken_once():
    commands = load_commands()
    modules = {cmd.handler.__module__ for cmd in commands.values()}
    assert modules == set(COMMAND_MODULES)
    assert len(commands) == len({cmd.handler for cmd in commands.values()})


@pytest.mark.parametrize(
    "argv, option, key",
    [
        (["pack", "--corpus", "c", "--tokenizer", "t", "--out", "o"], "memory_cap_mb", "data.memory_cap_mb"),
        (["pack", "--corpus", "c", "--tokenizer", "t", "--out", "o"], "block_tokens", "packing.block_tokens"),
        (["filter", "--kind", "dedup", "--corpus", "c", "--out", "o"], "dedup_threshold", "data.dedup_threshold"),
        (["filter", "--kind", "dedup", "--corpus", "c", "--out", "o"], "num_perm", "data.dedup_permutations"),
        (
            ["tokenizer", "--corpus", "c", "--vocab-size", "64", "--out", "o"],
            "min_frequency",
            "tokenizer.min_frequency",
        ),
        (
            [
                "finetune",
                "--checkpoint",
                "c",
                "--task",
                "sst2",
                "--data",
                "d",
                "--seed",
                "0",
                "--protocol",
                "{}",
                "--model",
                "m",
                "--vocab",
                "64",
                "--out",
                "o",
            ],
            "precision",
            "pretrain.precision",
        ),
    ],
)
def test_options_that_mirror_config_keys_default_to_the_schema(argv, option, key):
    args = build_parser().parse_args(argv)
    assert getattr(args, option) == schema_default(key)


def test_a_key_without_a_schema_default_is_named():
    with pytest.raises(KeyError, match="pretrain.nonexistent"):
        schema_default("pretrain.nonexistent")
