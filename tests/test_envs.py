"""The conda env used by --sdm conda pins exactly what pyproject.toml pins."""
import re
import tomllib

import yaml


def pins(lines):
    return dict(re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip()).groups() for line in lines)


def test_env_pins_match_pyproject(repo):
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    wanted = pins(project["dependencies"])
    wanted.pop("snakemake")  # the env runs jobs; Snakemake itself runs outside it
    env = yaml.safe_load((repo / "envs" / "cramswarm.yaml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert pins(pip_section) == wanted
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python="))
    assert project["requires-python"] == ">=" + python.split("=")[1]


def test_every_rule_with_a_command_names_the_env(repo):
    for smk in (repo / "rules").glob("*.smk"):
        text = smk.read_text()
        envs = re.findall(r'^( *)conda:\n\1    "\.\./envs/cramswarm\.yaml"$', text, re.MULTILINE)  # any indentation
        assert len(re.findall(r"^ *shell:$", text, re.MULTILINE)) == len(envs), smk.name
