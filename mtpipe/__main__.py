"""``python -m mtpipe`` (also what ``torchrun -m mtpipe train`` runs)."""

from mtpipe.cli import app

if __name__ == "__main__":
    app(prog_name="mtpipe")
