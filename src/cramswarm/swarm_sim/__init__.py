"""Throughput models of a SWARM: the swarm package's routing, rebalancing and fault policies driven without training.

* ``sim``         the discrete-event simulator (virtual time; + ``sim_state``, ``sim_network``, ``sim_lifecycle``);
* ``emulation``   the payload-free throughput emulation on the swarm package's threads (``swarm.thread_swarm``);
* ``scenarios``   large heterogeneous setups and their failure and join schedules;
* ``optimum``     the yardstick: the throughput of the best assignment of peers to stages.

Both read a ``swarm.setups.SwarmSetup`` and return the same result keys. Above ``cramswarm.swarm`` (which never
imports this package) and beneath the experiments (``cramswarm.swarm_study``) and the benchmarks.
"""
