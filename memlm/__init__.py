"""memlm: a continual-learning kNN-LM datastore with the MoNIM memorisation policy."""

__version__ = "0.1.0"
