"""postable: a model with a fixed sinusoidal position table, built once on the device."""
