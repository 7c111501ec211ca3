"""SWARM parallelism (Ryabinin et al., ICML 2023) re-implemented on crammed BERT.

Modules (imported explicitly; nothing is imported here, so ``import cramswarm.swarm`` never pulls in hivemind):

* ``policies``     pure routing, fault and synchronisation policies (stochastic wiring / IWRR balancer, retry
                   policy, adaptive rebalancer, in-stage batch accounting); time is passed in, no I/O;
* ``compression``  inter-stage compression (fp16, blockwise absmax 8-bit, bottleneck and maxout layers);
* ``stages``       splitting the crammed-BERT MLM model into pipeline stages and assembling it back;
* ``emulation``    transport 2: stage peers and trainers as threads in one process (emulated speed, network
                   and failures), a throughput emulation ``run`` and a real training ``train``;
* ``sim``          transport 3: discrete-event simulator driving the same policy objects;
* ``hivemind_transport``  transport 1: one OS process per peer over hivemind's DHT and RPC (the plan and the
                   entry points ``run_swarm`` / ``train``; every swarm runs under ``launcher``, no coordinator);
* ``membership`` / ``wire``  transport 1's lowest layer: the DHT address file, joining and keys; the streamed
                   message format;
* ``hivemind_peer`` / ``peer_sync`` / ``peer_rebalance`` / ``peer_process``  the stage peer (its RPCs), its
                   peer-driven in-stage steps, its moves, and its processes (bootstrap, stage, attached task);
* ``trainer`` / ``launcher`` / ``processes``  the trainer process, the launcher that starts and restarts the
                   processes, and process-group management;
* ``train``        ``swarm_pretrain``: the swarm_pretrain rule's command.

The SWARM paper's experiments (rule ``swarm_study``) are ``cramswarm.swarm_study``, above this package: nothing
here imports them or the network testbed (``lint-imports``).
"""
