"""cramswarm: a Snakemake reproduction of Cramming (arXiv 2212.14034) and SWARM parallelism (arXiv 2301.11913).

Importing the package is light: it does not import torch or transformers, so ``python -m cramswarm --help``
and the report commands start at once. The crammed-BERT architecture is registered with transformers' Auto
classes by ``import cramswarm.models`` (which every code path that builds or loads a model imports), so a
checkpoint written by the workflow loads with::

    import cramswarm.models  # registers model_type "crammed-bert"
    from transformers import AutoModelForMaskedLM
    model = AutoModelForMaskedLM.from_pretrained("results/.../checkpoints/crammed/v2048")

If transformers is already imported when ``cramswarm`` is, the registration happens at once as well.
"""

import sys

__version__ = "0.1.0"

if "transformers" in sys.modules:  # the user is loading models anyway: register now, as before
    try:
        import cramswarm.models  # noqa: F401
    except ImportError:  # torch missing: config and data tools still work
        pass
