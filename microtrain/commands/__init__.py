"""The commands: the click command lines and the Python functions beneath them, sweeps,
plots, checkpoints and federated training."""
