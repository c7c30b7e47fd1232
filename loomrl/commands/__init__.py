"""The commands a user runs beside training, apart from the library they use: `loomrl doctor`
(and its trace), `plan`, `export`, `report` and every `bench`. They import the core (trainer,
parts, engines, sources); the core never imports them (tests/test_layout_imports.py)."""
