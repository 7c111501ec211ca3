"""The preflight (rule ``preflight``): the study rehearsed on a slice on this device and projected to the full run.

* ``rehearse``  measures: the data stages on a slice of the real corpus, each model's training step at its real
                micro-batch, one GLUE task's fine-tuning step;
* ``project``   pure arithmetic: the full run's hours, tokens, memory, disk and data wrap, and a verdict per job;
* ``run``       the two together, and the report (``results/preflight/{source}/report.{json,md}``);
* ``commands``  the ``preflight`` command.
"""
