# The preflight (named target): the study rehearsed on a slice on this machine before the full run spends hours.
import shlex


rule preflight:
    """The study rehearsed on a slice here and projected to the full run: per data stage the rate, hours, memory and
    disk; per pretraining model tokens/s, MFU, peak memory, hours, tokens and where the data wraps; fine-tuning hours;
    a verdict per job with the key to change (results/preflight/<source>/report.md). Fails when a job will not fit
    (the report is then in the log)."""
    output:
        report=f"results/preflight/{SOURCE}/report.json",
        page=f"results/preflight/{SOURCE}/report.md",
    log:
        f"logs/preflight/{SOURCE}.log",
    conda:
        "../envs/cramswarm.yaml"
    resources:
        mem_mb=preflight_mem_mb,
        runtime=BASE_MINUTES + 60,
        gpu=gpus(IMPL["device"]),
    params:
        configfiles=" ".join(shlex.quote(path) for path in CONFIG_FILES),  # this run's, in order
        out_dir=lambda wildcards, output: os.path.dirname(output.report),
    shell:
        "python -m cramswarm preflight --configfile {params.configfiles} --out-dir {params.out_dir} > {log} 2>&1"
