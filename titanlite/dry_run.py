"""`python -m titanlite.dry_run`: a shim over titanlite.cli.dry_run (nothing imports this module)."""

from titanlite.cli.dry_run import main

if __name__ == "__main__":
    raise SystemExit(main())
