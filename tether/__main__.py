"""`python -m tether`: the `tether` command."""

from tether.cli.main import app

app(prog_name="tether")
