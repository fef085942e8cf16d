"""The step compiler: a split's graphs prepared once into closures over planned arrays,
with the kernels, reduced precision, loss scaling and the optimizers."""
