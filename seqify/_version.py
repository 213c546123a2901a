"""The one place seqify's version is written: the package (``seqify.__version__``) and its build read it."""

__version__ = "0.1.0"
