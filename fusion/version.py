"""The package version, defined once: fusion.__version__ and the header of explain() read it."""

__version__ = "0.1.0"
