"""The command line's subcommands (``python -m cudaflash bench`` and ``tune``; __main__ wires
them up): on top of the runtime, through its public names."""
