"""The ``fleetbatch`` command: one entry point whose subcommands are the parts (``fleetbatch gateway serve``,
``fleetbatch engine serve``, ``fleetbatch loadgen demo``, ``fleetbatch sim scale``, ...). The top layer: it
dispatches to each part's own CLI module (``python -m <package>.cli`` keeps working for internal calls)."""
