"""decoupled_diloco: resilient, asynchronous, multi-island training in JAX."""
