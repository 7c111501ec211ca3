"""The SWARM paper's experiments (rule ``swarm_study``), each run on the swarm package's transports.

* ``study``           the experiments, one CSV each: square-cube, wiring throughput, failures timeline,
                      rebalancing recovery, compression vs loss (``compression_loss``: one process, no transport),
                      the simulator at scale; ``common``: their thread count and CSV writer;
* ``study_launcher``  an emulation ``SwarmSetup`` run on the launcher's real processes (the ``testbed`` transport
                      and ``benchmarks/swarm_launcher.py``), optionally on testbed hosts (``cramswarm.testbed``);
* ``commands``        the ``swarm-study`` command.

Above ``cramswarm.swarm`` and ``cramswarm.testbed``: the swarm package never imports its experiments.
"""
