"""SWARM parallelism (Ryabinin et al., ICML 2023) re-implemented on crammed BERT.

Nothing is imported here, so ``import cramswarm.swarm`` never pulls in hivemind: import the modules explicitly. What
each module does, by transport: docs/swarm.md, "Design". In short:

* pure policies (time passed in, no I/O): ``routing``, ``rebalancing``, ``fault_rules``, ``stage_sync``, ``work``;
* shared by the transports: ``compression``, ``stages``, ``setups``, ``train`` and ``commands`` (the commands);
  ``replica`` (a stage's compute, gradients and step) by the two training transports;
* transport 1, real hivemind processes: ``hivemind_transport`` (the plan, ``run_swarm``, ``train``), ``launcher``
  (+ ``run_state``, ``run_result``, ``launcher_faults``, ``processes``, ``srun``), ``trainer`` (+ ``data``), the
  stage peer ``hivemind_peer`` / ``peer_sync`` (+ ``progress``, ``shards``, ``averaging``) / ``peer_rebalance`` /
  ``peer_process``, and beneath them ``membership`` and ``wire``;
* transport 2, threads of one process: ``thread_swarm``, ``emulation_training``.

The throughput models that run the same policies without training (the discrete-event simulator, the thread
emulation of throughput, scenarios and the optimum) are ``cramswarm.swarm_sim``, and the SWARM paper's experiments
(rule ``swarm_study``) ``cramswarm.swarm_study``, both above this package: nothing here imports them or the network
testbed (``lint-imports``).
"""
