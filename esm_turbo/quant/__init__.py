"""Codecs for the KV cache and weights."""

#: bit widths the scalar codebooks (Lloyd-Max tables) come in
SUPPORTED_BITS = (1, 2, 3, 4, 8)
