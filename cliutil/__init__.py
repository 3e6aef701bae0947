"""The shared ``main()`` of the console scripts (:func:`run_main`): parse the arguments, set up
logging (``-v``), run the command, and turn an expected error into a one-line message and an
exit code. A bottom package: it imports nothing of the project, so every CLI may use it. :mod:`cliutil.config_file`: ``--config-file`` and ``FLEETBATCH_<OPTION>``
environment variables for the commands that offer them."""

from cliutil.config_file import ConfigFileError, enable_config_file, env_name, options_model
from cliutil.main import LOG_FORMAT_ENV, PLAIN_LOG, TIMESTAMPED_LOG, VERBOSE_ENV, command_of, run_main

__all__ = [
    "ConfigFileError",
    "enable_config_file",
    "env_name",
    "options_model",
    "LOG_FORMAT_ENV",
    "PLAIN_LOG",
    "TIMESTAMPED_LOG",
    "VERBOSE_ENV",
    "command_of",
    "run_main",
]
