"""ecsnap benchmarks: each writes JSON lines to ``bench/results/`` and prints a table."""
