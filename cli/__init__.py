"""rung.cli: the `rung` command (the one package above bench/)."""
