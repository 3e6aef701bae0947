"""The shared ``main()`` of the console scripts (:func:`run_main`): parse the arguments, set up
logging (``-v``), run the command, and turn an expected error into a one-line message and an
exit code. A bottom package: it imports nothing of the project, so every CLI may use it."""

from cliutil.main import LOG_FORMAT_ENV, PLAIN_LOG, TIMESTAMPED_LOG, VERBOSE_ENV, command_of, run_main

__all__ = ["LOG_FORMAT_ENV", "PLAIN_LOG", "TIMESTAMPED_LOG", "VERBOSE_ENV", "command_of", "run_main"]
