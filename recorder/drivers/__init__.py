"""Drivers: what runs episodes against a policy and hands each finished trajectory on.

Below them is the recording itself (``recorder``: segments, trajectories, the wrapper, the
store, the batch layouts), which knows nothing of how episodes are scheduled; above them are the
integrations and the command line, which call them. One episode's turn loop is written once
(:func:`~tokengym.recorder.drivers.runner.play`) and shared by every driver:

* ``runner``: ``play`` (one episode) and ``drive`` (many, each at its own pace, on one event loop);
* ``episodes``: an env copy and its episode's state (``EpisodeSlot``), the plan of tasks and groups,
  the progress bar;
* ``rollout``: :func:`~tokengym.recorder.rollout`, the local entry point (async or lock-step), which also picks the pool or Ray;
* ``process_backend``: env steps in local worker processes, the policy in the driver's (``backend="processes"``);
* ``ray_backend``: the Ray driver, with its actors in ``ray_actors`` (env workers, policy engines);
* ``model_setup``: a ``--model`` argument turned into a policy and the env's chat template.

Nothing is re-exported here, so each name above is its module; the functions users call are
re-exported by :mod:`tokengym.recorder`.
"""
