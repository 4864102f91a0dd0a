"""`python -m titanlite.data`: see titanlite.cli.data."""

from titanlite.cli.data import main

raise SystemExit(main())
