"""The ``tokengym`` command line: one module per command.

``tokengym check-template`` tells in seconds whether a tokenizer's chat template can be
used token-faithfully for a real conversation, turn by turn; ``tokengym demo`` records a
multi-turn tool episode and shows its tokens and masks; ``tokengym rollout`` records a run
into a store, continuing it when run again (exit status: 0 all finished, 3 some episodes
failed, 130 stopped by Ctrl-C or SIGTERM, 2 refused or bad arguments, 1 the run could not go
on; see :data:`ROLLOUT_EXIT_CODES`).

``main`` builds the parser (``parser.py``); each subcommand lives in its own module: ``rollout``,
``demo``, ``check_template`` (and ``fetch-tokenizers``), ``list_envs``, ``inspect_store`` and ``view``.
"""

from .parser import build_parser, main

__all__ = ["build_parser", "main"]
