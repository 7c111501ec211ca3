"""SWARM parallelism (Ryabinin et al., ICML 2023) re-implemented on crammed BERT.

Modules (imported explicitly; nothing is imported here, so ``import cramswarm.swarm`` never pulls in hivemind):

* ``routing`` / ``rebalancing`` / ``fault_rules`` / ``stage_sync``  the pure policies (time is passed in, no I/O):
                   a trainer's routing and retries (stochastic wiring / IWRR balancer, retry policy, a microbatch's
                   path), adaptive rebalancing (load meter, move rule and gate), the replicas a fault may take, and
                   in-stage batch accounting;
* ``compression``  inter-stage compression (fp16, blockwise absmax 8-bit, bottleneck and maxout layers);
* ``stages``       splitting the crammed-BERT MLM model into pipeline stages and assembling it back;
* ``setups``       the setup of a throughput run (peers, failure and join events), shared by transports 2 and 3;
                   ``scenarios`` builds large ones and their preemptions, ``optimum`` their best throughput;
* ``thread_swarm`` / ``emulation`` / ``emulation_training``  transport 2: stage peers and trainers as threads in
                   one process (emulated speed, network and failures), a throughput emulation ``run`` and a real
                   training ``train``;
* ``sim``          transport 3: discrete-event simulator driving the same policy objects (its state, network and
                   peer lifecycle in ``sim_state``, ``sim_network``, ``sim_lifecycle``);
* ``hivemind_transport``  transport 1: one OS process per peer over hivemind's DHT and RPC (the plan and the
                   entry points ``run_swarm`` / ``train``; every swarm runs under ``launcher``, no coordinator);
* ``membership`` / ``wire``  transport 1's lowest layer: the DHT address file, joining and keys; the streamed
                   message format;
* ``hivemind_peer`` / ``peer_sync`` / ``peer_rebalance`` / ``peer_process``  the stage peer (its RPCs), its
                   peer-driven in-stage steps, its moves, and its processes (bootstrap, stage, attached task);
* ``trainer`` / ``launcher`` / ``processes``  the trainer process, the launcher that starts and restarts the
                   processes (its run folder and resume in ``run_state``, its fault injection in
                   ``launcher_faults``, the end of its run in ``run_result``), and process-group management;
* ``train``        ``swarm_pretrain``: the swarm_pretrain rule's command.

The SWARM paper's experiments (rule ``swarm_study``) are ``cramswarm.swarm_study``, above this package: nothing
here imports them or the network testbed (``lint-imports``).
"""
