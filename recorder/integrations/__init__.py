"""Integrations: tokengym's envs and buffers inside other RL libraries' trainers.

* ``verl``: ``TokenGymAgentLoop``, an agent loop verl's own ``AgentLoopWorker`` runs;
* ``trl``: a ``rollout_func`` for TRL's ``GRPOTrainer`` (episodes through the shared driver);
* ``skyrl``: tokengym envs registered as SkyRL-Gym environments.

Nothing is imported here: each module needs its library (verl, TRL, SkyRL), imported when used.
"""
