"""`python -m titanlite.generate`: a shim over titanlite.cli.generate (nothing imports this module)."""

from titanlite.cli.generate import entry

if __name__ == "__main__":
    entry()
