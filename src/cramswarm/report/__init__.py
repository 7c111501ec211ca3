"""Report assembly: GLUE tables (:mod:`.tables`) and figures (:mod:`.figures`) from fine-tuning results."""
