"""A multi-host network testbed on one machine: hosts in Linux network namespaces, shaped links, a delaying relay.

One role per module: :mod:`~cramswarm.testbed.netns` (namespaces, veth links, the bridge, processes in the
hosts, clean-up), :mod:`~cramswarm.testbed.shaping` (bandwidth with tbf, link cuts), :mod:`~cramswarm.testbed.relay`
(latency, jitter and UDP loss in user space: the kernel has no netem), :mod:`~cramswarm.testbed.measure` (what
processes on the hosts see), :mod:`~cramswarm.testbed.swarm` (the launcher's hivemind swarm with every process on
a host of its own; imported on demand: it needs hivemind). docs/swarm.md ("Testbed") says what it emulates and
what it does not.
"""

from cramswarm.testbed.netns import Host, Testbed, Unavailable, cleanup, run_namespaces, unavailable_reason

__all__ = ["Host", "Testbed", "Unavailable", "cleanup", "run_namespaces", "unavailable_reason"]
