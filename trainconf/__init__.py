"""trainconf: the host-side tool that prepares a model for training on the device."""
