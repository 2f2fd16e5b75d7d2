"""The `ray` transport: rollout workers, the learner and the parameter server as Ray actors.

cluster.py (join or start a cluster), worker.py (the rollout worker actor), pool.py (the worker
pool: the engine contract over remote workers, health checks, replacement), learner.py (the
learner actor and the driver's client of it), param_server.py (the parameter-server actor).
The trainer imports this package; nothing here imports the trainer. `ray` itself is imported
lazily, inside functions, so the local transport never needs it.
"""
