"""``python -m tokengym.recorder.cli ...``: the same as the ``tokengym`` script."""

from .parser import main

raise SystemExit(main())
