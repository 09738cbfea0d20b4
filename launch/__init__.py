"""What launches the method and sizes it: the set-up around the loop (setup.py), the probe that picks the sizes on
CPU (sizing.py), and inference ranks fed over torch.distributed (remote.py). Imports the top-level files; nothing at
the top level but trainer.py imports this package."""
