"""`python -m titanlite.train`: a shim over titanlite.cli.train (nothing imports this module)."""

from titanlite.cli.train import entry

if __name__ == "__main__":
    entry()
