"""`python -m titanlite.checkpoint`: see titanlite.cli.checkpoint."""

from titanlite.cli.checkpoint import main

raise SystemExit(main())
