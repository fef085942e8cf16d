"""microtrain: the device-side runtime that trains a model split by trainconf."""
