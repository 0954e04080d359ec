"""``tokengym view DIR``: a local page over the runs in a store folder.

The runs in the folder, their episodes (filtered by reward, finish and stop reason, conformance,
task and GRPO group; paged, never loaded whole), one episode's token stream with the policy's
tokens shaded by logprob, its per-turn rewards, tool calls, conformance results and images where
they stand, and two episodes of a group side by side. Modules: ``catalog`` (the runs and their
episode indexes, read from the stores' small columns), ``episode`` (one row, its tokens as pieces),
``server`` (127.0.0.1 only, the JSON API and the page in ``static/``).
"""

from .catalog import EpisodeFilter, EpisodeIndex, Run, find_runs
from .episode import episode_json, read_episode, token_pieces
from .server import Viewer, ViewerServer

__all__ = ["EpisodeFilter", "EpisodeIndex", "Run", "Viewer", "ViewerServer", "episode_json", "find_runs",
           "read_episode", "token_pieces"]
