# cramswarm: reproduce Cramming (arXiv 2212.14034) and SWARM parallelism (arXiv 2301.11913) end to end.
# corpus -> filters -> tokenizers (one per vocab size) -> packed and ordered blocks -> MLM pretraining -> GLUE
# fine-tuning per (model, task, seed) -> tables and figures. `snakemake --list-rules` describes every rule;
# docs/ the layout.
from snakemake.utils import min_version

min_version("9.20")  # runtime units fixed in 9.20 (snakemake#4053)


configfile: "config/config.yaml"


report: "rules/workflow.rst"  # the front page of `snakemake --report`


include: "rules/common.smk"  # validates the config; each rule file's functions: src/cramswarm/workflow/
include: "rules/outputs.smk"  # report() figures and tables
include: "rules/data.smk"
include: "rules/tokenizers.smk"
include: "rules/pretrain.smk"
include: "rules/swarm.smk"
include: "rules/glue.smk"
include: "rules/report.smk"
include: "rules/docs.smk"  # named target `docs`: README/docs numbers from committed results
include: "rules/ablations.smk"  # named targets only
include: "rules/preflight.smk"  # named target `preflight`: the study rehearsed on a slice, projected


rule all:
    """The study: GLUE tables (ours and with the paper's rows), figures and the study record."""
    default_target: True
    input:
        GLUE_TABLES,
        GLUE_PAPER_TABLES,
        FIGURES,
        rules.study_record.output,  # config, software versions, benchmark summary: the head of the report


rule tokenizers:
    """Every tokenizer of the vocab sweep (the study's data recipe)."""
    input:
        [data_files(STUDY_DATA, vocab)["tokenizer"] for vocab in VOCABS],


rule pretrain_all:
    """Every checkpoint of the study (pretrained and random-init)."""
    input:
        [f"{checkpoint_dir(m, v)}/model.safetensors" for m, v in STUDY_RUNS],


rule glue:
    """Tables 3/4-style GLUE table (median over seeds), also with the paper's published rows."""
    input:
        GLUE_TABLES,
        GLUE_PAPER_TABLES,


rule apart:
    """The models kept out of the study (models.<name>.study: false), each pretrained and fine-tuned, in their own
    GLUE table (results/tables/<source>/glue_apart.{csv,md})."""
    input:
        APART_TABLES if APART_RUNS else [],


rule ablation_vocab:
    """Figure 3: GLUE average and MNLI vs vocab size (the vocab-sweep models at every tokenizer.vocab_sizes)."""
    input:
        rules.vocab_sweep.output,


rule ablation_arch:
    """Figure 1 / Table 11: MLM loss vs tokens and fine-tuned scores per shape variant."""
    input:
        rules.ablation_arch_report.output,


rule ablation_schedule:
    """Figure 2: LR schedules x peak LR."""
    input:
        rules.ablation_schedule_report.output,


rule ablation_groups:
    """Table 5: architecture / training recipe reset to original BERT's."""
    input:
        rules.ablation_groups_report.output,


rule ablation_data:
    """Table 2: corpus sources x {none, filtered, filtered + sorted} plus dedup on/off."""
    input:
        rules.ablation_data_report.output,


rule swarm_study:
    """SWARM: square-cube law, wiring, failures, rebalancing, compression vs loss, simulator at scale."""
    input:
        rules.swarm_report.output,


rule claims:
    """The papers' claims, checked: runs every experiment the claims need, then the verdict table
    (results/claims/<source>/claims.{csv,md}; docs/claims.md)."""
    input:
        rules.claims_table.output,


rule pretraining_gap:
    """Claim C5's experiment alone (pretraining >> no pretraining): every GLUE run of the crammed and no-pretraining
    models, with the pretraining (and schedule sweep) they need; `claims_available` then writes the table."""
    input:
        claim_inputs("C5"),


rule readme:
    """The README's results figures (small copies, committed under results/readme/)."""
    input:
        rules.readme_figures.output,
