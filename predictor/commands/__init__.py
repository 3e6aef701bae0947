"""The ``predictor`` subcommands, one module each: ``add_arguments(parser)`` declares a
subcommand's options and ``run(args) -> dict`` does the work and returns the JSON object that
:mod:`predictor.cli` prints as the last line. :mod:`predictor.commands.common` holds what they share."""
