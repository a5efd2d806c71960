"""The command line: parser and dispatch in app.py (the entry point, app.main), one
module per command group. Empty on purpose: every command module imports this package
first, so an import of app here would make each of them import app, and app imports
them (tests/test_layers.py: no circle in cli/)."""
