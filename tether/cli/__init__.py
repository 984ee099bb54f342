"""The `tether` command line (typer + rich)."""
