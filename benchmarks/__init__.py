"""The benchmarks behind `python bench.py <which>`: one module per subcommand, each readable alone."""
