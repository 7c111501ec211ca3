"""The conda env used by --sdm conda pins exactly what pyproject.toml pins."""
import re
import tomllib

import pytest
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


def test_the_package_installed_as_a_wheel_validates_the_checkouts_config(repo, tmp_path):
    """A non-editable install has no config/ beside it: run from the checkout, it finds the checkout's schema."""
    import subprocess
    import sys

    pytest.importorskip("setuptools", reason="builds the wheel without build isolation (no index needed)")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "wheel"), str(repo)], check=True, capture_output=True)
    wheel = next((tmp_path / "wheel").glob("cramswarm-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True, capture_output=True)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "site"), "HOME": str(tmp_path)}
    found = subprocess.run([sys.executable, "-c", "import cramswarm, cramswarm.config as c; "
                            "print(cramswarm.__file__); print(c.DEFAULT_SCHEMA)"],
                           cwd=repo, env=env, check=True, capture_output=True, text=True).stdout.split()
    assert found[0].startswith(str(tmp_path / "site")) and found[1] == str(repo / "config" / "schema.yaml")
    subprocess.run([sys.executable, "-m", "cramswarm", "check-config", "config/config.yaml"], cwd=repo, env=env,
                   check=True, capture_output=True)
