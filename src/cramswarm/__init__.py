"""cramswarm: a Snakemake reproduction of Cramming (arXiv 2212.14034) and SWARM parallelism (arXiv 2301.11913).

Importing the package registers the crammed-BERT architecture with transformers' Auto classes, so a
checkpoint written by the workflow loads with ``AutoModelForMaskedLM.from_pretrained(dir)`` or
``AutoModelForSequenceClassification.from_pretrained(dir, num_labels=...)``.
"""

__version__ = "0.1.0"


def _register() -> None:
    try:
        from cramswarm.models.crammed_bert import register
    except ImportError:  # torch/transformers missing: config and data tools still work
        return
    register()


_register()
