"""`flashmax bench`: sparsemax implementations timed side by side against a measured memory-copy floor.

Run `flashmax bench --help` (or `python -m flashmax.bench --help`) for the options.
"""
