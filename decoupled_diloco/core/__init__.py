"""Pure math on parameter pytrees: outer gradients, outer rounds, merge-back, fragments, codecs.

Imports only jax, numpy and optax: no grpc, threads, absl or config.
"""
