"""`python -m compactrl.cli ...`, as the study runner and the serve benchmark start it."""

from compactrl.cli import app

if __name__ == "__main__":
    app()
