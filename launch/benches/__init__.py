"""The benchmarks behind `python -m launch.bench NAME`: a module each, shared helpers in common."""
