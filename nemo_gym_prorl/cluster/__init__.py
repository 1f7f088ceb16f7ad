"""Scale-out on Ray: the service's head keeps its HTTP API, job store, queues, deadlines, cancellation and metrics;
each rollout's init / run / eval runs in a worker actor on some node, with its sandboxes local to that node.

- `settings`: the ``ray`` knobs of ``prorl serve``.
- `worker`: the worker actor (environments, sandboxes and its own LLM pool on its node).
- `fleet`: the head's view of the workers: starting them on every node, placement by free sandbox slots, node loss.
- `remote_rollout`: one rollout's environment and agent loop as the head's pipeline sees them, run on a worker.
- `fleet_pool`: the head's LLM pool, whose backends and weight-sync pause/resume reach every worker.
"""
