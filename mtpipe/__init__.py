"""mtpipe: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as a machine-translation toolkit."""

__version__ = "0.1.0"
