"""amaxscale: simulated fp8 activations with delayed scaling from a running maximum."""
