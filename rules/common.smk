# Config validation, the wildcards, and the names the rule files use. Their functions are plain Python, one module
# per rule file (rules/pretrain.smk: src/cramswarm/workflow/pretrain.py; what several share: workflow/study.py), each
# taking the study built here from the validated config, bound to it by cramswarm.workflow.rule_names.
import json
import os
import re
import sys
from pathlib import Path

# Import the package from this checkout (not from whichever checkout pip's editable install points at).
sys.path.insert(0, str(Path(workflow.basedir) / "src"))

from cramswarm.config import ConfigError, validate_config
from cramswarm.glue_tasks import TASK_NAMES
from cramswarm.workflow import Study, rule_names

try:
    validate_config(config, Path(workflow.basedir) / "config" / "schema.yaml", base_dir=Path.cwd())
except ConfigError as err:
    raise WorkflowError(str(err))

# Jobs import the package from this checkout even inside a conda env (--sdm conda) that lacks it; cluster jobs
# inherit it (the SLURM plugin exports the environment). No `envvars:` declaration: that directive asserts
# variables the user must set, and PYTHONPATH is optional (extended here, never required).
os.environ.update(
    PYTHONPATH=os.pathsep.join(filter(None, [str(Path(workflow.basedir) / "src"), os.environ.get("PYTHONPATH")]))
)

# The config's names (SOURCE, RUNS, STUDY_RUNS, the file patterns CORPUS ... FINETUNE, the tables' paths) and every
# input, params and resource function of the rules, bound to this run's study (its config files, the GPU model and
# GPUs per process of profiles/slurm, read from the environment once).
STUDY = Study.from_config(config, workflow.configfiles)
globals().update(rule_names(STUDY))


wildcard_constraints:
    source="synthetic|hub",
    corpus="|".join(map(re.escape, CORPORA)),
    filters=r"raw|trash[0-9.]+|dedup[0-9.]+|trash[0-9.]+-dedup[0-9.]+",
    family="wordpiece|bpe|unigram",
    order="random|sentence-length|unigram|unigram-reverse",
    vocab=r"\d+",
    seed=r"\d+",
    task="|".join(TASK_NAMES),
    model="|".join(map(re.escape, RUNS)),


# Local runs: every job holds `cpu_cores` (its threads; profiles/default) out of this machine's cores, whatever --cores
# says, so `snakemake --cores 8` on 2 cores runs two one-thread jobs at a time, the longest first (`priority`), instead
# of eight at a quarter of a core each with the longest (the critical path) finishing last. Cluster runs (--jobs) and
# an explicit --resources cpu_cores=N are left as they are.
if workflow.global_resources["_nodes"].value is None and "cpu_cores" not in workflow.global_resources:
    workflow.register_resource("cpu_cores", max(len(os.sched_getaffinity(0)), 2))  # 2: the swarm rule's threads
